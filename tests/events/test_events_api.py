"""The REST API of ``vision-serve ui``: search, paging, snapshots, auth, the live stream,
re-describe, the cameras view, and that untrusted text stays data.

Real uvicorn on loopback, real Redis and SQLite; re-describe goes to the recording
OpenAI-compatible double.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from pipelines.events.app import CSP
from pipelines.queue import accounting
from tests.events.events_helpers import API_KEY, decode_jpeg, describe, get
from tests.pipelines.pipeline_helpers import VLMDouble, wait_until

pytestmark = pytest.mark.timeout(60)
STATIC = Path(__file__).resolve().parents[2] / "pipelines" / "events" / "static"
XSS = "<img src=x onerror=alert(1)>"


def stored(ui, n: int) -> None:
    wait_until(lambda: ui.store.count_events() == n, 10, what=f"{n} events stored")


def test_search_finds_an_event_by_a_word_of_its_text(config, ui):
    describe(config, ["a courier in a yellow jacket leaves a parcel", "an empty corridor"])
    stored(ui, 2)
    found = get(ui.url, "/api/events", q="jacket").json()["data"]
    assert [e["text"] for e in found] == ["a courier in a yellow jacket leaves a parcel"]
    stemmed = get(ui.url, "/api/events", q="leaving").json()["data"]  # porter: leave*
    assert len(stemmed) == 1
    assert get(ui.url, "/api/events", q="zebra").json()["data"] == []


@pytest.mark.parametrize("q", ['"unterminated', "AND", "jacket NOT", "nocolumn:word", "(a OR"])
def test_a_malformed_search_is_a_400_not_a_500(config, ui, q):
    describe(config, ["something to search"])
    stored(ui, 1)
    response = get(ui.url, "/api/events", q=q)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "q" and error["type"] == "invalid_request_error"


def test_paging_walks_every_event_once_newest_first(config, ui):
    now = time.time()
    for i in range(7):
        describe(config, [f"event number {i}"], ts=now - 100 + i)
    stored(ui, 7)
    pages, before = [], None
    while True:
        params = {"limit": 3, **({"before": before} if before else {})}
        body = get(ui.url, "/api/events", **params).json()
        pages.append([e["text"] for e in body["data"]])
        before = body["next"]
        if not before:
            break
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [t for page in pages for t in page] == [f"event number {i}" for i in range(6, -1, -1)]


def test_filters_by_camera_and_time(config, ui):
    now = time.time()
    describe(config, ["front one"], camera="front", ts=now - 3600)
    describe(config, ["back one"], camera="back", ts=now - 60)
    stored(ui, 2)
    assert [e["text"] for e in get(ui.url, "/api/events", camera="back").json()["data"]] == [
        "back one"
    ]
    recent = get(ui.url, "/api/events", since=str(now - 600)).json()["data"]
    assert [e["text"] for e in recent] == ["back one"]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 600))
    assert [e["text"] for e in get(ui.url, "/api/events", until=iso).json()["data"]] == [
        "front one"
    ]


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 201},
        {"limit": 0},
        {"before": "nonsense"},
        {"since": "yesterday"},
        {"q": "x" * 300},
    ],
)
def test_bad_parameters_are_400s(ui, params):
    response = get(ui.url, "/api/events", **params)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_snapshot_is_a_jpeg_with_and_without_boxes(config, ui):
    (uid,) = describe(config, ["someone by the window"])
    stored(ui, 1)
    raw = get(ui.url, f"/api/events/{uid}/snapshot.jpg", boxes=0)
    boxed = get(ui.url, f"/api/events/{uid}/snapshot.jpg", boxes=1)
    for response in (raw, boxed):
        assert response.status_code == 200
        assert response.headers["content-type"] == "image/jpeg"
        assert response.content[:3] == b"\xff\xd8\xff"
        assert response.headers["cache-control"] == "no-store"
    plain, drawn = decode_jpeg(raw.content), decode_jpeg(boxed.content)
    assert plain.shape == drawn.shape == (120, 160, 3)
    # the box's left edge (x=20, y 40..100) is drawn green over the purple block
    edge = drawn[40:100, 20].astype(int).mean(axis=0)
    assert edge[1] > 150 and edge[2] < 80, edge
    assert plain[40:100, 20, 1].mean() < 100  # the raw frame has no box
    assert get(ui.url, "/api/events/nope/snapshot.jpg").status_code == 404


def test_the_api_key_is_required_on_the_api_only(ui):
    for key in (None, "wrong-key"):
        response = get(ui.url, "/api/events", key=key)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert get(ui.url, "/api/cameras", key=None).status_code == 401
    assert get(ui.url, "/api/events/stream", key=None).status_code == 401
    assert get(ui.url, "/api/events").status_code == 200
    for path in ("/health", "/", "/static/events.js", "/static/events.css"):
        assert get(ui.url, path, key=None).status_code == 200, path


def test_every_response_carries_a_strict_content_security_policy(ui):
    page = get(ui.url, "/", key=None)
    csp = page.headers["content-security-policy"]
    assert csp == CSP
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert get(ui.url, "/api/events").headers["content-security-policy"] == CSP


def test_the_live_stream_delivers_a_new_event(config, ui):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("GET", f"{ui.url}/api/events/stream", headers=headers, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines).startswith("retry:")
        (uid,) = describe(config, ["a new arrival"])
        deadline = time.monotonic() + 10
        data = None
        for line in lines:
            if line.startswith("data:"):
                data = json.loads(line[5:])
                break
            assert time.monotonic() < deadline, "no event on the stream"
    assert data["id"] == uid and data["text"] == "a new arrival" and data["seq"] >= 1


def test_the_live_stream_resumes_after_a_given_seq(config, ui):
    describe(config, ["first", "second", "third"])
    stored(ui, 3)
    first = min(e["seq"] for e in get(ui.url, "/api/events").json()["data"])
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{ui.url}/api/events/stream?after={first}"
    with httpx.stream("GET", url, headers=headers, timeout=10) as r:
        got = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                got.append(json.loads(line[5:])["text"])
            if len(got) == 2:
                break
    assert sorted(got) == ["second", "third"]


def test_redescribe_replaces_the_text_and_keeps_the_previous_one(config, start_ui, tmp_path):
    with VLMDouble() as vlm:
        config.describer.base_url = vlm.base_url
        ui = start_ui(config)
        (uid,) = describe(config, ["first words about a ladder"])
        stored(ui, 1)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        response = httpx.post(f"{ui.url}/api/events/{uid}/describe", headers=headers, timeout=20)
        assert response.status_code == 200, response.text
        event = response.json()
        assert event["text"] == "double description #1"
        assert [h["text"] for h in event["history"]] == ["first words about a ladder"]
        # what the endpoint got: the stored frame, the camera's prompt with the detections
        content = vlm.requests[0]["messages"][0]["content"]
        assert content[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
        assert "Camera: door" in content[1]["text"] and "person 0.90" in content[1]["text"]
    again = get(ui.url, f"/api/events/{uid}").json()
    assert again["text"] == "double description #1" and len(again["history"]) == 1
    assert [e["id"] for e in get(ui.url, "/api/events", q="double").json()["data"]] == [uid]
    assert get(ui.url, "/api/events", q="ladder").json()["data"] == []  # index follows
    assert ui.store.counters()["redescribed"] == 1


def test_redescribe_with_the_endpoint_down_is_a_503_and_changes_nothing(
    config, start_ui, closed_port_url
):
    config.describer.base_url = closed_port_url
    ui = start_ui(config)
    (uid,) = describe(config, ["unchanged"])
    stored(ui, 1)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(f"{ui.url}/api/events/{uid}/describe", headers=headers, timeout=20)
    assert response.status_code == 503 and response.json()["error"]["code"] == "vlm_unavailable"
    assert get(ui.url, f"/api/events/{uid}").json()["text"] == "unchanged"


def test_untrusted_text_is_returned_as_data(config, ui):
    (uid,) = describe(config, [XSS])
    stored(ui, 1)
    response = get(ui.url, f"/api/events/{uid}")
    assert response.headers["content-type"] == "application/json"
    assert response.json()["text"] == XSS
    assert get(ui.url, "/api/events", q="onerror").json()["data"][0]["text"] == XSS


def test_the_page_never_parses_data_as_html():
    """The page's script builds elements and sets text only; the page has no inline script."""
    script = (STATIC / "events.js").read_text()
    code = re.sub(r"//[^\n]*", "", script)  # the header comment names what is not used
    sinks = [
        "innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
        "new Function", 'setAttribute("on', "DOMParser", "createContextualFragment",
    ]  # fmt: skip
    for sink in sinks:
        assert sink not in code, sink
    assert "textContent" in code
    page = (STATIC / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", page) == ['<script src="/static/events.js" defer>']
    assert not re.search(r"\son[a-z]+\s*=", page)  # no inline event handlers
    assert "style=" not in page


def test_cameras_show_the_latest_event_and_the_queue_from_redis(config, ui, redis_server):
    config.cameras = []  # cameras seen in events are listed too
    now = time.time()
    describe(config, ["older at the door"], camera="door", ts=now - 30)
    describe(config, ["newer at the door"], camera="door", ts=now - 5)
    describe(config, ["in the yard"], camera="yard")
    stored(ui, 3)
    body = get(ui.url, "/api/cameras").json()
    cams = {c["id"]: c for c in body["data"]}
    assert cams["door"]["latest"]["text"] == "newer at the door"
    assert cams["yard"]["latest"]["text"] == "in the yard"
    assert cams["yard"]["redis_latest"]["persons"] == "1"
    live = accounting(redis_server.client(), config.queue)
    assert body["redis"]["accounting"]["described"] == live["described"] == 4 - 1
    assert body["redis"]["accounting"]["holds"] is True
    assert body["redis"]["queue"]["pending"] == 0
    assert body["events"]["stored"] == 3 and body["events"]["consumer"]["running"]


@pytest.fixture
def closed_port_url() -> str:
    from tests.pipelines.pipeline_helpers import free_port

    return f"http://127.0.0.1:{free_port()}/v1"
