"""Several endpoints for the describers: balance by queue depth, out on failure, back on recovery.

The endpoints here are doubles that inject one condition each (a deep queue in ``/metrics``,
a failing ``/health``, a closed port); the describers, Redis and the ``openai`` SDK are real.
The two-replica run against ``vision-serve serve`` is ``test_endpoint_failover.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pipeline_helpers import (
    DescriberThread,
    VLMDouble,
    described_per_frame,
    descriptions,
    enqueue_frames,
    free_port,
    wait_until,
)

from pipelines import metrics
from pipelines.endpoints import queue_depth
from pipelines.queue import accounting

pytestmark = pytest.mark.timeout(60)


class ServerDouble:
    """An OpenAI-compatible endpoint with vLLM's ``/health`` and ``/metrics``: ``depth`` is
    the queue its metrics report, ``health`` the status ``/health`` answers."""

    def __init__(self) -> None:
        self.depth = 0
        self.health = 200
        self.served = 0
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(double.health, b"{}", "application/json")
                elif self.path == "/metrics":
                    text = (
                        "# TYPE vllm:num_requests_waiting gauge\n"
                        f'vllm:num_requests_waiting{{model_name="tiny"}} {double.depth}.0\n'
                        'vllm:num_requests_running{model_name="tiny"} 0.0\n'
                    )
                    self._send(200, text.encode(), "text/plain")
                else:
                    self._send(404, b"{}", "application/json")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                double.served += 1
                body = {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "tiny",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "a person"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
                }
                self._send(200, json.dumps(body).encode(), "application/json")

            def _send(self, status: int, data: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.name = f"127.0.0.1:{self.server.server_address[1]}"
        self.base_url = f"http://{self.name}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def doubles():
    pair = ServerDouble(), ServerDouble()
    yield pair
    for double in pair:
        double.close()


def endpoint_config(make_config, redis_url: str, *endpoints: str, **describer: Any):
    return make_config(
        redis_url,
        describer={
            "endpoints": [{"base_url": url} for url in endpoints],
            "probe_interval_s": 0.2,
            **describer,
        },
    )


def test_frames_go_to_the_endpoint_with_the_shorter_queue(redis_server, doubles, make_config):
    x, y = doubles
    x.depth = 50
    config = endpoint_config(make_config, redis_server.url, x.base_url, y.base_url)
    q = config.queue
    client = redis_server.client()
    with DescriberThread(config, "w1") as worker:
        pool = worker.describer.pool
        wait_until(
            lambda: (pool.endpoints[0].depth, pool.endpoints[1].depth) == (50, 0),
            10,
            what="both depths read",
        )
        enqueue_frames(redis_server.url, q, 6)
        wait_until(lambda: len(descriptions(client, q)) == 6, 15, what="6 described")
        assert (x.served, y.served) == (0, 6)
        # the queues turn around: so does the traffic
        x.depth, y.depth = 0, 50
        # both reads, not only Y's: a frame sent while X's old 50 still stood beside Y's new
        # 50 went to either (a CI run saw 3 of the 6 at Y)
        wait_until(
            lambda: (pool.endpoints[0].depth, pool.endpoints[1].depth) == (0, 50),
            10,
            what="both depths re-read",
        )
        enqueue_frames(redis_server.url, q, 6, camera="later")
        wait_until(lambda: len(descriptions(client, q)) == 12, 15, what="12 described")
    assert (x.served, y.served) == (6, 6)
    assert {d["endpoint"] for d in descriptions(client, q) if d["camera"] == "later"} == {x.name}


def test_equal_queues_share_the_frames(redis_server, doubles, make_config):
    x, y = doubles
    config = endpoint_config(make_config, redis_server.url, x.base_url, y.base_url)
    client = redis_server.client()
    enqueue_frames(redis_server.url, config.queue, 8)
    with DescriberThread(config, "w1"):
        wait_until(lambda: len(descriptions(client, config.queue)) == 8, 15, what="described")
    assert x.served > 0 and y.served > 0 and x.served + y.served == 8


def test_a_failing_health_check_takes_an_endpoint_out_until_it_passes(
    redis_server, doubles, make_config, caplog
):
    caplog.set_level(logging.INFO, logger="pipelines.endpoints")
    x, y = doubles
    config = endpoint_config(make_config, redis_server.url, x.base_url, y.base_url)
    q = config.queue
    client = redis_server.client()
    with DescriberThread(config, "w1") as worker:
        ep_x = worker.describer.pool.endpoints[0]
        x.health = 503
        up_gauge = metrics.ENDPOINT_UP.labels(x.name)
        # the gauge follows the state on the describer's loop: wait for both
        wait_until(lambda: not ep_x.up and up_gauge._value.get() == 0, 10, what="X out")
        enqueue_frames(redis_server.url, q, 4)
        wait_until(lambda: len(descriptions(client, q)) == 4, 15, what="4 described")
        assert (x.served, y.served) == (0, 4)
        x.health = 200
        wait_until(lambda: ep_x.up and up_gauge._value.get() == 1, 10, what="X back in")
        enqueue_frames(redis_server.url, q, 4, camera="later")
        wait_until(lambda: len(descriptions(client, q)) == 8, 15, what="8 described")
    assert x.served > 0
    assert metrics.ENDPOINT_TRANSITIONS.labels(x.name, "down")._value.get() == 1
    changes = [r.getMessage() for r in caplog.records if f"endpoint={x.name}" in r.getMessage()]
    assert [m.split()[0] for m in changes if "why=health_check" in m] == [
        "event=endpoint_down",
        "event=endpoint_up",
    ]


def test_a_dead_endpoint_costs_frames_nothing_and_is_tried_again_when_it_listens(
    redis_server, doubles, make_config
):
    """No server on A's port at all: its requests fail, the frames go to B uncounted; when a
    server without /health appears on the port, a trial request puts A back."""
    _, b = doubles
    port = free_port()
    a_url = f"http://127.0.0.1:{port}/v1"
    config = endpoint_config(
        make_config, redis_server.url, a_url, b.base_url, concurrency=2, max_failures=1
    )
    q = config.queue
    client = redis_server.client()
    enqueue_frames(redis_server.url, q, 10)
    with DescriberThread(config, "w1") as worker:
        wait_until(lambda: len(descriptions(client, q)) == 10, 15, what="10 described")
        state = accounting(client, q)
        assert state["holds"] and state["described"] == 10 and state["dead"] == 0
        assert set(described_per_frame(client, q).values()) == {1}
        assert b.served == 10
        ep_a = worker.describer.pool.endpoints[0]
        assert not ep_a.up
        with VLMDouble(port=port) as a:  # no /health: only a request can tell
            deadline = time.monotonic() + 20
            while not a.requests and time.monotonic() < deadline:
                enqueue_frames(redis_server.url, q, 2, camera=f"t{time.monotonic_ns()}")
                time.sleep(0.3)
            assert a.requests, "A was never tried again"
            wait_until(lambda: ep_a.up, 10, what="A back in rotation")
    assert accounting(client, q)["holds"]


def test_queue_depth_reads_ours_vllm_and_llama_cpp():
    ours = "vision_serve_num_requests_waiting 3.0\nvision_serve_num_requests_running 2.0\n"
    vllm = 'vllm:num_requests_waiting{model_name="m"} 4.0\nvllm:num_requests_running{a="b"} 1\n'
    llama = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 6\n"
    assert (queue_depth(ours), queue_depth(vllm), queue_depth(llama)) == (5, 5, 7)
    assert queue_depth("# nothing here\nprocess_cpu_seconds_total 3\n") is None
