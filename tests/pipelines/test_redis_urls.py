"""Redis past one box: ``redis+sentinel://`` against a real redis-sentinel,
``redis+cluster://`` against a real (one-node) cluster, and the URL rules.

The sentinel and cluster tests run the real producer (sync client) and a real describer
(asyncio client) through the URL; the queue's accounting holds.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from pipeline_helpers import (
    DescriberThread,
    RedisServer,
    descriptions,
    free_port,
    kill_group,
    wait_until,
)

from pipelines.config import ConfigError
from pipelines.queue import accounting, connect
from pipelines.redis_urls import cluster_key_problem, parse_sentinel_url

pytestmark = pytest.mark.timeout(60)


class Sentinel:
    """``redis-server <conf> --sentinel`` watching one master as ``mymaster``."""

    def __init__(self, workdir: Path, master: RedisServer) -> None:
        self.port = free_port()
        conf = workdir / "sentinel.conf"
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            "protected-mode no",
            f"dir {workdir}",
            f"sentinel monitor mymaster 127.0.0.1 {master.port} 1",
            "sentinel down-after-milliseconds mymaster 5000",
        ]
        if master.password:
            lines.append(f"sentinel auth-pass mymaster {master.password}")
        conf.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen(
            ["redis-server", str(conf), "--sentinel", "--logfile", str(workdir / "s.log")],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)

        def knows_master() -> bool:
            try:
                return bool(
                    client.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")
                )
            except redis.ConnectionError:
                return False

        wait_until(knows_master, 15, what="sentinel knows mymaster")
        client.close()

    def stop(self) -> None:
        kill_group(self.proc)


def enqueue_through(url: str, q, n: int) -> None:
    """``n`` frames through the real producer (``FrameQueue``) connected by ``url``."""
    from pipelines.detect import Detection
    from pipelines.ingest import Frame
    from pipelines.queue import FrameQueue, Outgoing

    queue = FrameQueue(url, q, on_drop=lambda _camera, reason: pytest.fail(reason))
    queue.start()
    image = np.zeros((32, 32, 3), np.uint8)
    for i in range(n):
        det = Detection(0, "person", 0.9, (1.0, 1.0, 20.0, 20.0))
        queue.submit(Outgoing(Frame("cam", i, time.time(), image), [det], "first"))
    wait_until(lambda: queue.enqueued == n, 10, what=f"{n} frames enqueued")
    queue.stop(flush_timeout=1)


@pytest.fixture
def sentinel_master(tmp_path):
    master = RedisServer(tmp_path / "master", password="s3cret")
    master.start()
    sentinel = Sentinel(tmp_path, master)
    try:
        yield master, sentinel
    finally:
        sentinel.stop()
        master.stop()


def test_producer_and_describer_reach_the_master_through_sentinel(
    sentinel_master, vlm_double, make_config
):
    master, sentinel = sentinel_master
    url = f"redis+sentinel://:s3cret@127.0.0.1:{sentinel.port},127.0.0.1:{free_port()}/mymaster/0"
    config = make_config(url, describer={"base_url": vlm_double.base_url})
    q = config.queue
    enqueue_through(url, q, 3)
    with DescriberThread(config, "w1"):
        wait_until(lambda: len(descriptions(master.client(), q)) == 3, 15, what="3 described")
    state = accounting(connect(url), q)
    assert state["holds"] and state["described"] == 3 and state["pending"] == 0
    # it is the master's data: the sentinel only named it
    assert master.client().xlen(q.descriptions_stream) == 3


CLUSTER_KEYS = {
    "frames_stream": "{vs}:frames",
    "descriptions_stream": "{vs}:descriptions",
    "dead_letter_stream": "{vs}:frames:dead",
    "stats_key": "{vs}:stats",
    "latest_prefix": "{vs}:latest:",
    "image_prefix": "{vs}:frame:",
    "dedupe_prefix": "{vs}:enqueued:",
    "producer_prefix": "{vs}:producer:",
    "camera_prefix": "{vs}:camera:",
}


@pytest.fixture
def cluster_node(tmp_path):
    """A one-node Redis Cluster (every slot on it): real cluster protocol, MOVED rules and
    the one-slot rule for scripts, in a second."""
    port = _cluster_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "no",
         "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"),
         "--dir", str(tmp_path), "--save", "", "--logfile", str(tmp_path / "cluster.log")],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        wait_until(lambda: _pings(client), 60, what="cluster node up")
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_until(
            lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"),
            60,
            what="cluster state ok",
        )
        yield port
    finally:
        client.close()
        kill_group(proc)


def _cluster_port() -> int:
    """A free port a cluster node accepts: its bus listens 10,000 higher, so at most 55535
    (an ephemeral port above that makes redis-server exit at start)."""
    for _ in range(200):
        port = free_port()
        if port <= 55535:
            return port
    raise RuntimeError("no free port <= 55535 for a cluster node")


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:  # refused, or a timeout while the node starts on a busy machine
        return False


def test_producer_and_describer_run_on_a_cluster_with_hash_tagged_keys(
    cluster_node, vlm_double, make_config
):
    url = f"redis+cluster://127.0.0.1:{cluster_node}/0"
    config = make_config(url, describer={"base_url": vlm_double.base_url}, queue=CLUSTER_KEYS)
    q = config.queue
    enqueue_through(url, q, 3)
    client = connect(url)
    with DescriberThread(config, "w1"):
        wait_until(lambda: len(descriptions(client, q)) == 3, 15, what="3 described")
    state = accounting(client, q)
    assert state["holds"] and state["described"] == 3 and state["pending"] == 0


def test_sentinel_url_parts():
    target = parse_sentinel_url(
        "redis+sentinel://:p%40ss@h1:26380,[::1],h3/mymaster/2?sentinel_password=x"
    )
    assert target.sentinels == (("h1", 26380), ("::1", 26379), ("h3", 26379))
    assert (target.service, target.db, target.password, target.username) == (
        "mymaster", 2, "p@ss", None,
    )  # fmt: skip
    assert target.sentinel_password == "x" and not target.ssl
    assert parse_sentinel_url("rediss+sentinel://u:p@h/svc").ssl


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h1:26379", "no service name"),
        ("redis+sentinel://h1:port/m", "the port must be a number"),
        ("redis+sentinel://h1/m/x", "/<service_name>[/<db number>]"),
        ("redis+sentinel://h1/m?foo=1", "unknown option"),
        ("memcached://h1", "must start with one of"),
    ],
)
def test_bad_redis_urls_are_config_errors_without_the_password(make_config, url, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_config(url.replace("://", "://:hunter2@", 1))
    try:
        make_config(url.replace("://", "://:hunter2@", 1))
    except ConfigError as exc:
        assert "hunter2" not in str(exc)


def test_cluster_urls_need_one_hash_tag_on_every_queue_key(make_config):
    with pytest.raises(ConfigError, match="one hash slot"):
        make_config("redis+cluster://127.0.0.1:7000/0")
    assert make_config("redis+cluster://127.0.0.1:7000/0", queue=CLUSTER_KEYS).queue.stats_key
    mixed = {**CLUSTER_KEYS, "stats_key": "{x}:stats"}
    assert "different hash tags" in cluster_key_problem(mixed)
