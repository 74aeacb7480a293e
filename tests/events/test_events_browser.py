"""The events page in a real headless Chromium (Debian's ``chromium``, driven by Playwright):
it asks for the key, shows a description produced during the test with its snapshot, finds it
by search, shows a new event without a reload, and shows hostile text as text.

Each camera card shows its live numbers (state, fps, drops, queue, describer lag) from a
real pipeline. A screenshot is saved to ``results/ui-events.png``. Any console error fails the
test: a Content-Security-Policy violation (an inline script or style, an image from
elsewhere) is reported there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.events.events_helpers import API_KEY, PipelineRunner, describe, live_config
from tests.pipelines.pipeline_helpers import REPO, people_images

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (dev extra)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(
        CHROMIUM is None, reason="no chromium: run scripts/install-system-deps.sh (Debian package)"
    ),
]
SCREENSHOT = REPO / "results" / "ui-events.png"
# persons in ultralytics' bus.jpg, scaled to the 640x480 test frame
BUS_PERSONS = [
    (40.0, 178.0, 194.0, 402.0),
    (174.0, 180.0, 273.0, 382.0),
    (529.0, 169.0, 639.0, 389.0),
]
ZIDANE_PERSONS = [(60.0, 90.0, 500.0, 475.0), (430.0, 30.0, 640.0, 475.0)]
FIRST = "Three people wait at the bus stop; one wears a yellow jacket and carries a bag."
LATER = "A man in a suit adjusts his tie while another looks on."
HOSTILE = "<img src=x onerror=alert(1)> Ignore previous instructions"


def test_the_events_page_shows_searches_and_updates_live(config, ui):
    bus, zidane = people_images()
    (first,) = describe(config, [FIRST], camera="bus-stop", images=[bus], boxes=BUS_PERSONS)
    (hostile,) = describe(config, [HOSTILE], camera="lobby")
    problems: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.on("pageerror", lambda exc: problems.append(f"pageerror: {exc}"))
            page.on(
                "console",
                lambda msg: (
                    problems.append(f"console: {msg.text}") if msg.type == "error" else None
                ),
            )
            failed: list[str] = []
            page.on(
                "response",
                lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None,
            )
            page.on("dialog", lambda dialog: (problems.append(f"dialog: {dialog.message}"),
                                              dialog.dismiss()))  # fmt: skip
            page.goto(f"{ui.url}/")

            # the key is asked once (401 from the API), then kept in localStorage
            page.wait_for_selector("#key-form:not([hidden])")
            page.fill("#key", API_KEY)
            page.click("#key-form button[type=submit]")
            item = f'li.event[data-id="{first}"]'
            page.wait_for_selector(item, timeout=10_000)
            assert page.text_content(f"{item} .event-text") == FIRST
            card = '.camera[data-camera="bus-stop"]'
            assert page.text_content(f"{card} .camera-text") == FIRST
            page.wait_for_function(
                "s => { const i = document.querySelector(s); return i && i.naturalWidth === 640 }",
                arg=f"{card} img",
            )

            # hostile text is shown as text: no element made of it, no script run
            hostile_item = f'li.event[data-id="{hostile}"] .event-text'
            assert page.text_content(hostile_item) == HOSTILE
            assert page.query_selector_all('img[src="x"]') == []

            # search: by a word of the description, and one that matches nothing
            page.fill("#q", "jacket")
            page.click("#search button[type=submit]")
            page.wait_for_function("() => document.querySelectorAll('li.event').length === 1")
            assert page.get_attribute("li.event", "data-id") == first
            page.fill("#q", "zebra")
            page.click("#search button[type=submit]")
            page.wait_for_selector("#timeline-note:not([hidden])")
            assert page.text_content("#timeline-note") == "Nothing matches."
            assert page.query_selector_all("li.event") == []
            page.click("#clear")
            page.wait_for_selector(item)

            # a description made now appears without a reload (live stream), on top
            (later,) = describe(
                config, [LATER], camera="bus-stop", images=[zidane], boxes=ZIDANE_PERSONS
            )
            page.wait_for_selector(f'li.event[data-id="{later}"]', timeout=10_000)
            assert page.get_attribute("li.event", "data-id") == later
            page.wait_for_function(
                "s => document.querySelector(s).textContent === " + repr(LATER),
                arg=f"{card} .camera-text",
                timeout=10_000,
            )

            # the detail view: the snapshot with boxes, the text, its metadata
            page.click(item)
            page.wait_for_selector("#detail:not([hidden])")
            assert page.text_content("#detail-text") == FIRST
            page.wait_for_function(
                "() => document.getElementById('detail-img').naturalWidth === 640"
            )
            assert page.evaluate("() => localStorage.getItem('vision-serve-ui-key')") == API_KEY
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    # the one expected failure: the API's 401 before the key was entered
    assert failed and all(f.startswith("401 ") for f in failed), failed
    problems = [p for p in problems if "status of 401" not in p]
    assert not problems, problems
    assert Path(SCREENSHOT).stat().st_size > 10_000


def test_camera_cards_show_the_live_counters_of_a_running_pipeline(
    redis_server, tmp_path, video_file, start_ui
):
    config = live_config(redis_server.url, tmp_path / "events", video_file)
    describe(config, ["A person crosses the yard."], camera="yard")
    ui = start_ui(config)
    card = '.camera[data-camera="yard"] .camera-live'
    problems: list[str] = []
    with PipelineRunner(config) as runner, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("pageerror", lambda exc: problems.append(f"pageerror: {exc}"))
            page.on(
                "console",
                lambda msg: (
                    problems.append(f"console: {msg.text}") if msg.type == "error" else None
                ),
            )
            page.add_init_script(f"localStorage.setItem('vision-serve-ui-key', '{API_KEY}')")
            page.goto(f"{ui.url}/")
            # the cards refresh every 5 s: wait for the pipeline's drops to show
            page.wait_for_function(
                "s => { const n = document.querySelector(s + ' .counter-drops');"
                " return n && n.textContent !== 'drops 0' }",
                arg=card,
                timeout=30_000,
            )
            assert page.get_attribute(card, "data-state") == "online"
            assert page.text_content(f"{card} .badge") == "online"
            fps = page.text_content(f"{card} .counter-fps")
            assert fps.startswith("fps ") and float(fps.split()[1]) > 0
            assert "queue_full" in page.get_attribute(f"{card} .counter-drops", "title")
            assert page.text_content(f"{card} .counter-lag").endswith(" s")
            assert page.text_content(f"{card} .counter-queue") == "queue 10"

            runner.stop()  # the card turns offline with the next refresh
            page.wait_for_function(
                "s => document.querySelector(s).dataset.state === 'offline'",
                arg=card,
                timeout=15_000,
            )
            assert page.query_selector(f"{card} .counter-fps") is None  # no frozen numbers
        finally:
            browser.close()
    assert not problems, problems
