"""Camera readers against a real RTSP server on loopback, a file, and a dead address."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from pipeline_helpers import free_port, wait_until

from pipelines.config import CameraConfig, IngestConfig
from pipelines.ingest import CameraReader, Frame, LatestFrameSlot

pytestmark = pytest.mark.timeout(90)

INGEST = IngestConfig(open_timeout_s=5, read_timeout_s=3, backoff_initial_s=0.2, backoff_max_s=1)


@pytest.fixture
def reader_factory():
    readers: list[CameraReader] = []

    def build(url, fps: float = 2.0, **kw) -> CameraReader:
        reader = CameraReader(CameraConfig(id=f"cam{len(readers)}", url=url, fps=fps, **kw), INGEST)
        readers.append(reader)
        reader.start()
        return reader

    yield build
    for reader in readers:
        reader.stop()


def take_frames(reader: CameraReader, n: int, timeout: float) -> list[Frame]:
    frames: list[Frame] = []

    def got() -> bool:
        frame = reader.slot.take()
        if frame is not None:
            frames.append(frame)
        return len(frames) >= n

    wait_until(got, timeout, interval=0.02, what=f"{n} frames from {reader.camera.id}")
    return frames


def test_rtsp_frames_are_sampled_at_the_camera_fps(rtsp_server, reader_factory) -> None:
    reader = reader_factory(rtsp_server.url, fps=2)
    take_frames(reader, 1, 15)
    start_sampled, start_decoded = reader.stats.sampled, reader.stats.decoded
    frames = take_frames(reader, 4, 10)
    sampled = reader.stats.sampled - start_sampled
    decoded = reader.stats.decoded - start_decoded
    assert reader.stats.connected
    assert frames[0].image.shape == (480, 640, 3)
    # the stream runs at 5 fps; we convert only ~2 of them per second
    assert decoded >= 2 * sampled - 2
    assert [f.seq for f in frames] == sorted(f.seq for f in frames)
    assert frames[-1].ts - frames[0].ts == pytest.approx(1.5, abs=0.6)


def test_reader_reconnects_after_the_rtsp_server_restarts(rtsp_server, reader_factory) -> None:
    reader = reader_factory(rtsp_server.url, fps=5)
    take_frames(reader, 2, 15)
    rtsp_server.stop()
    wait_until(lambda: not reader.stats.connected, 10, what="disconnect noticed")
    assert reader.stats.reconnects >= 1
    time.sleep(1.0)  # the reader retries against a closed port meanwhile
    reader.slot.take()
    rtsp_server.start()  # same port
    frames = take_frames(reader, 3, 20)
    assert reader.stats.connected
    assert frames[-1].ts > time.time() - 5


def test_a_stalled_stream_is_detected_by_the_read_timeout(rtsp_server, reader_factory) -> None:
    reader = reader_factory(rtsp_server.url, fps=5)
    take_frames(reader, 2, 15)
    rtsp_server.proc.send_signal(signal.SIGSTOP)  # connection stays open, no data flows
    try:
        wait_until(lambda: reader.stats.reconnects >= 1, 30, what="stall")
        assert not reader.stats.connected
    finally:
        rtsp_server.proc.send_signal(signal.SIGCONT)
    reader.slot.take()
    take_frames(reader, 2, 20)
    assert reader.stats.connected


def test_file_sources_play_in_real_time_and_loop(video_file, reader_factory) -> None:
    reader = reader_factory(str(video_file), fps=10)  # the file is 5 fps, 4 s long
    take_frames(reader, 1, 10)
    time.sleep(5.0)
    # real time: ~25 frames in 5 s, not the whole file in a burst; looped at least once
    assert 15 <= reader.stats.decoded <= 40
    assert reader.stats.reconnects >= 1 and reader.stats.connected


def test_dead_source_backs_off_and_counts_attempts(reader_factory) -> None:
    reader = reader_factory(f"rtsp://127.0.0.1:{free_port()}/nothing")
    time.sleep(2.5)
    # 0.2 s doubling to 1 s: about 4-6 attempts in 2.5 s, not hundreds
    assert 2 <= reader.stats.reconnects <= 8
    assert not reader.stats.connected and reader.stats.sampled == 0


def test_a_sample_not_taken_in_time_is_replaced_and_counted() -> None:
    drops: list[str] = []
    slot = LatestFrameSlot(drops.append)
    image = np.zeros((2, 2, 3), np.uint8)
    slot.put(Frame("c", 1, 0.0, image))
    slot.put(Frame("c", 2, 0.0, image))
    assert slot.take().seq == 2 and slot.take() is None
    assert drops == ["detector_busy"]
