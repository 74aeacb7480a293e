""" "Describe again" goes through the describer's endpoint pool (issue #19): with two
endpoints and the first one down it is answered by the second, with every endpoint down it
is a 503 in the API's error shape, and a camera's ``response_schema`` is sent and its
fields stored as the describer stores them.

Real uvicorn, Redis and SQLite on loopback. The healthy replica is a real
``vision-serve serve`` in the slow test; the fast ones use the recording OpenAI-compatible
double only to play the healthy replica beside a port on which nothing listens.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.events.events_helpers import API_KEY, describe, get, make_config
from tests.pipelines.pipeline_helpers import (
    VLMDouble,
    free_port,
    kill_group,
    spawn_logged,
    wait_healthy,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"enum": [0, 1, 2, 3]},
        "activity": {"enum": ["walking", "standing", "running", "none"]},
    },
    "required": ["people", "activity"],
    "additionalProperties": False,
}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def closed_url() -> str:
    """An endpoint on which nothing listens (a replica that is down)."""
    return f"http://127.0.0.1:{free_port()}/v1"


def pool_config(redis_url: str, data_dir: Path, endpoints: list[dict], **describer) -> object:
    cameras = [{"id": "door", "url": "unused.mp4", "describer": {"response_schema": SCHEMA}}]
    return make_config(
        redis_url,
        data_dir,
        cameras=cameras,
        describer={"endpoints": endpoints, "probe_interval_s": 0.5, **describer},
    )


def redescribe(ui, uid: str) -> httpx.Response:
    return httpx.post(f"{ui.url}/api/events/{uid}/describe", headers=HEADERS, timeout=60)


def one_event(config, ui, text: str) -> str:
    (uid,) = describe(config, [text])
    wait_until(lambda: ui.store.count_events() == 1, 10, what="the event stored")
    return uid


def test_the_first_endpoint_down_the_second_answers_with_the_schema_sent(
    redis_server, start_ui, tmp_path
):
    with VLMDouble() as second:
        endpoints = [
            {"base_url": closed_url(), "name": "first"},
            {"base_url": second.base_url, "name": "second"},
        ]
        config = pool_config(redis_server.url, tmp_path / "events", endpoints)
        ui = start_ui(config)
        uid = one_event(config, ui, "before")
        response = redescribe(ui, uid)
        assert response.status_code == 200, response.text
        event = response.json()
        assert event["text"] == "double description #1"
        assert [h["text"] for h in event["history"]] == ["before"]
        # the camera's schema went with the request, as the describer sends it
        sent = second.requests[0]["response_format"]
        assert sent["type"] == "json_schema" and sent["json_schema"]["schema"] == SCHEMA
        pool = ui.app.state.redescribe.pool
        states = {ep.name: ep.up for ep in pool.endpoints}
        assert states == {"first": False, "second": True}
        # the down endpoint is out of rotation: the next one goes straight to the second
        again = redescribe(ui, uid)
        assert again.status_code == 200, again.text
        assert again.json()["text"] == "double description #2" and len(second.requests) == 2
        assert event["structured"] is None  # the double's answer is no JSON object
    assert ui.store.counters()["redescribed"] == 2


def test_every_endpoint_down_is_a_503_and_changes_nothing(redis_server, start_ui, tmp_path):
    endpoints = [{"base_url": closed_url(), "name": "a"}, {"base_url": closed_url(), "name": "b"}]
    config = pool_config(redis_server.url, tmp_path / "events", endpoints)
    ui = start_ui(config)
    uid = one_event(config, ui, "unchanged")
    for _ in range(2):  # first both fail as requests, then both are out of rotation
        response = redescribe(ui, uid)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "vlm_unavailable" and error["type"] == "server_error"
        assert error["message"].startswith("VLM endpoint unavailable")
    assert get(ui.url, f"/api/events/{uid}").json()["text"] == "unchanged"
    assert "redescribed" not in ui.store.counters()
    assert not any(ep.up for ep in ui.app.state.redescribe.pool.endpoints)


def test_the_pool_is_made_on_first_use_and_its_probes_stop_with_the_app(
    redis_server, start_ui, tmp_path
):
    with VLMDouble() as vlm:
        config = pool_config(redis_server.url, tmp_path / "events", [{"base_url": vlm.base_url}])
        ui = start_ui(config)
        holder = ui.app.state.redescribe
        assert holder.pool is None  # nothing probes an endpoint until someone re-describes
        uid = one_event(config, ui, "before")
        assert redescribe(ui, uid).status_code == 200
        probes = holder.probes
        assert probes is not None and not probes.done()
        ui.stop()
        assert probes.cancelled() and holder.pool is None


@pytest.fixture
def real_server(tiny_qwen2_vl: Path, tmp_path: Path) -> Iterator[str]:
    """``vision-serve serve`` with the tiny checkpoint; its ``/v1`` URL."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "vision_serve.cli", "serve", "--model", str(tiny_qwen2_vl)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
    proc = spawn_logged(cmd, log_path)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/health", log_path, "serve", 400, 0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        kill_group(proc)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_server_behind_a_down_one_answers_with_schema_valid_fields(
    redis_server, start_ui, tmp_path, real_server
):
    endpoints = [{"base_url": closed_url(), "name": "down"}, {"base_url": real_server}]
    config = pool_config(
        redis_server.url, tmp_path / "events", endpoints, max_tokens=64, timeout_s=60
    )
    ui = start_ui(config)
    uid = one_event(config, ui, "before")
    response = redescribe(ui, uid)
    assert response.status_code == 200, response.text
    event = response.json()
    # random weights: only the server's constrained decoding makes this valid
    fields = json.loads(event["text"])
    assert set(fields) == set(SCHEMA["required"])
    for name, value in fields.items():
        assert value in SCHEMA["properties"][name]["enum"]
    assert event["structured"] == fields and event["model"] == "tiny"
    assert [h["text"] for h in event["history"]] == ["before"]
    stored = get(ui.url, f"/api/events/{uid}").json()
    assert stored["structured"] == fields
