"""Video parts through a real server and the official ``openai`` client.

Two shapes: vLLM's ``{"type": "video_url", "video_url": {"url": <video file>}}`` (frames
sampled at ``--video-fps``, at most ``--max-video-frames``) and a list of frames
``{"type": "video", "video": [<image url>, ...], "fps": 2}`` (Qwen's API shape). The expected
prompt tokens are computed here from the grid arithmetic (frames 112x84, patch 14, spatial
merge 2, temporal patch 2), not by the code under test.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from vision_serve.settings import ServerSettings

from .support import data_url, make_image, start_server

WIDTH, HEIGHT = 112, 84  # multiples of 28: the processor keeps the size
TOKENS_PER_TEMPORAL_PATCH = (HEIGHT // 14) * (WIDTH // 14) // 4  # 12
MARKERS = 2  # <|vision_start|> and <|vision_end|> around the clip's placeholders


def clip_tokens(frames: int) -> int:
    temporal_patches = -(-frames // 2)  # an odd count repeats the last frame
    return temporal_patches * TOKENS_PER_TEMPORAL_PATCH + MARKERS


def frame_urls(n: int) -> list[str]:
    return [data_url(make_image(WIDTH, HEIGHT, (20 * k, 100, 200 - 10 * k))) for k in range(n)]


def write_video(path: Path, frames: int, fps: float) -> Path:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (WIDTH, HEIGHT))
    assert writer.isOpened()
    for k in range(frames):
        writer.write(np.full((HEIGHT, WIDTH, 3), (k * 7) % 256, np.uint8))
    writer.release()
    return path


def video_data_url(path: Path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def ask(client: openai.OpenAI, model: str, part: dict[str, Any], **kwargs: Any):
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Who is there?"}]}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=2, **kwargs)


@pytest.fixture(scope="module")
def text_tokens(server) -> int:
    with server.client() as client:
        resp = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Who is there?"}],
            max_tokens=2,
        )
    return resp.usage.prompt_tokens


@pytest.mark.parametrize("frames", [4, 3])
def test_frame_list_is_one_clip(client, server, text_tokens, frames):
    resp = ask(client, server.model, {"type": "video", "video": frame_urls(frames), "fps": 2})
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == text_tokens + clip_tokens(frames)


def test_video_file_is_sampled_at_the_server_rate(client, server, text_tokens, tmp_path):
    # 20 frames at 10 fps, sampled at 2 fps (the default): frames 0, 5, 10, 15
    url = video_data_url(write_video(tmp_path / "walk.mp4", 20, 10.0))
    resp = ask(client, server.model, {"type": "video_url", "video_url": {"url": url}})
    assert resp.usage.prompt_tokens == text_tokens + clip_tokens(4)


def test_long_video_is_thinned_to_max_frames(client, server, text_tokens, tmp_path):
    # 100 frames at 10 fps would give 20 frames at 2 fps; --max-video-frames 8 keeps 8
    url = video_data_url(write_video(tmp_path / "long.mp4", 100, 10.0))
    resp = ask(client, server.model, {"type": "video_url", "video_url": url})
    assert resp.usage.prompt_tokens == text_tokens + clip_tokens(8)


def test_video_file_from_allowed_local_path(client, server, text_tokens, media_dir):
    path = write_video(media_dir / "clip.mp4", 20, 10.0)
    resp = ask(client, server.model, {"type": "video_url", "video_url": {"url": path.as_uri()}})
    assert resp.usage.prompt_tokens == text_tokens + clip_tokens(4)


def _bad(client, model, part, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, model, part, **kwargs)
    return exc.value


def test_too_many_frames_is_400(client, server):
    err = _bad(client, server.model, {"type": "video", "video": frame_urls(9)})
    assert err.code == "too_many_frames"
    assert err.param == "messages[0].content[0].video"


def test_empty_frame_list_is_400(client, server):
    err = _bad(client, server.model, {"type": "video", "video": []})
    assert err.param == "messages[0].content[0].video"


def test_frames_of_different_sizes_are_400(client, server):
    urls = [data_url(make_image(WIDTH, HEIGHT)), data_url(make_image(56, 56))]
    err = _bad(client, server.model, {"type": "video", "video": urls})
    assert "one size" in err.message


def test_bad_frame_is_400_naming_it(client, server):
    urls = [*frame_urls(1), "data:image/png;base64,bm90IGFuIGltYWdl"]
    err = _bad(client, server.model, {"type": "video", "video": urls})
    assert err.param == "messages[0].content[0].video[1]"


def test_garbage_video_file_is_400(client, server):
    url = "data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode()
    err = _bad(client, server.model, {"type": "video_url", "video_url": {"url": url}})
    assert err.code == "invalid_video"
    assert err.param == "messages[0].content[0].video_url"


def test_image_mime_as_video_file_is_400(client, server):
    err = _bad(client, server.model, {"type": "video_url", "video_url": {"url": frame_urls(1)[0]}})
    assert err.code == "invalid_video"


def test_malformed_video_part_is_400(client, server):
    err = _bad(client, server.model, {"type": "video", "video": "not-a-list"})
    assert err.param == "messages[0].content[0]"


def test_frames_count_against_max_images_per_request(engine):
    handle = start_server(engine, ServerSettings(max_images_per_request=3))
    try:
        with handle.client() as client:
            err = _bad(client, handle.model, {"type": "video", "video": frame_urls(4)})
            assert err.code == "too_many_images"
            ok = ask(client, handle.model, {"type": "video", "video": frame_urls(3)})
            assert ok.usage.prompt_tokens > clip_tokens(3)
    finally:
        handle.stop()
