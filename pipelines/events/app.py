"""The events page and its REST API (FastAPI), with the consumer and retention in-process.

Auth: ``ui.api_key`` set (compose: required) means every ``/api/*`` route wants
``Authorization: Bearer <key>``, compared in constant time -- the VLM server's rule, the same
function (``vision_serve/auth.py``). The page itself (``/``, ``/static/*``) holds no data and
is open; its script asks for the key once, keeps it in the browser's ``localStorage`` and
sends it as that header on every call, the live stream included (read with ``fetch``, not
``EventSource``, which cannot send headers), and loads snapshots as blobs. So the key never
appears in a URL, a log line or a Referer.

Every response carries a strict Content-Security-Policy: scripts only from this origin (no
inline script), no ``innerHTML`` in the page's code, images only from here or blob URLs.
Descriptions are untrusted text: the API returns them as JSON data, the page sets them with
``textContent``.

Errors have the OpenAI/server shape ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipelines.config import PipelineConfig
from pipelines.events.consumer import EventConsumer
from pipelines.events.live import camera_records, describer_lag, queued_per_camera
from pipelines.events.retention import RetentionLoop
from pipelines.events.store import EventStore, QueryError
from pipelines.logs import kv
from pipelines.queue import accounting, queue_depth
from pipelines.redis_urls import make_client
from vision_serve.auth import bearer_key_dependency

if TYPE_CHECKING:
    from pipelines.endpoints import EndpointPool

log = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
MAX_QUERY_CHARS = 256
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class UIError(Exception):
    """An error response in the server's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class SecurityHeaders:
    """CSP and friends on every response; ``no-store`` on the API (camera images, live data)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = scope["path"].startswith("/api/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["content-security-policy"] = CSP
                headers["x-content-type-options"] = "nosniff"
                headers["referrer-policy"] = "no-referrer"
                headers["x-frame-options"] = "DENY"
                headers["cross-origin-resource-policy"] = "same-origin"
                if api:
                    headers["cache-control"] = "no-store"
            await send(message)

        await self.app(scope, receive, send_with_headers)


class Notifier:
    """Wakes the live streams (event loop) when the consumer (a thread) stored events.

    A stream takes a ``token()`` before it reads the store and then waits on it, so an insert
    between the read and the wait is not missed.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event = asyncio.Event()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def notify(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    def token(self) -> asyncio.Event:
        return self._event

    @staticmethod
    async def wait(token: asyncio.Event, timeout: float) -> bool:
        try:
            await asyncio.wait_for(token.wait(), timeout)
        except TimeoutError:
            return False
        return True


def parse_time(value: str | None, param: str) -> float | None:
    """Epoch seconds, or ISO 8601 (``2026-05-01T12:00:00Z``; no zone = UTC)."""
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except ValueError:
        try:
            when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise UIError(400, f"{param}: use epoch seconds or ISO 8601", param=param) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        return when.timestamp()
    if not math.isfinite(number):
        raise UIError(400, f"{param}: must be finite", param=param)
    return number


def parse_cursor(value: str | None) -> tuple[float, int] | None:
    """``before``: the ``next`` value of the previous page (``<ts>_<seq>``)."""
    if not value:
        return None
    ts, _, seq = value.rpartition("_")
    try:
        cursor = (float(ts), int(seq))
    except ValueError:
        raise UIError(400, "before: not a cursor from a previous page", param="before") from None
    if not math.isfinite(cursor[0]):
        raise UIError(400, "before: not a cursor from a previous page", param="before")
    return cursor


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(UIError)
    async def _ui_error(_: Request, exc: UIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = first.get("msg", "invalid request")
        return UIError(400, f"{param}: {message}" if param else message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return UIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return UIError(500, "internal server error", code="internal_error").response()


class RedescribePool:
    """The describer's ``EndpointPool`` for re-describe, made on first use (most ui processes
    never re-describe, and an unused pool would probe every endpoint forever).

    Its probe task (``EndpointPool.run``) starts with it: without probes an endpoint taken out
    of rotation by a failed request would only come back while every other one is down too.
    ``close()`` (the app's lifespan) cancels the task and closes the clients.
    """

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.pool: EndpointPool | None = None
        self.probes: asyncio.Task[None] | None = None

    def get(self) -> EndpointPool:
        if self.pool is None:
            from pipelines.endpoints import EndpointPool  # the VLM SDK: only when used

            self.pool = EndpointPool(self.config.describer)
            self.probes = asyncio.create_task(self.pool.run(), name="redescribe-probes")
        return self.pool

    async def close(self) -> None:
        if self.probes is not None:
            self.probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.probes
        if self.pool is not None:
            await self.pool.close()
        self.pool = self.probes = None


def create_app(config: PipelineConfig) -> FastAPI:
    """The app; its lifespan runs the consumer and the retention loop beside it."""
    store = EventStore(config.events.data_dir)
    notifier = Notifier()
    consumer = EventConsumer(config, store, on_stored=notifier.notify)
    retention = RetentionLoop(store, config.events)
    live = make_client(config.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    redescribe_slots = asyncio.Semaphore(config.ui.redescribe_concurrency)
    endpoints = RedescribePool(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        notifier.bind(asyncio.get_running_loop())
        consumer.start()
        retention.start()
        log.info(kv("ui_started", data_dir=store.root, auth=config.ui.api_key is not None))
        try:
            yield
        finally:
            await asyncio.to_thread(consumer.stop)
            await asyncio.to_thread(retention.stop)
            await endpoints.close()
            live.close()
            store.close()

    app = FastAPI(title="vision-serve events", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.store = store
    app.state.consumer = consumer
    app.state.retention = retention
    app.state.redescribe = endpoints  # its pool, once made: which endpoints are up
    install_error_handlers(app)
    app.add_middleware(SecurityHeaders)
    require_key = Depends(bearer_key_dependency(config.ui.api_key, UIError))
    api = APIRouter(prefix="/api", dependencies=[require_key])

    @api.get("/events")
    def list_events(
        camera: str | None = None,
        since: str | None = None,
        until: str | None = None,
        q: str | None = Query(None, max_length=MAX_QUERY_CHARS),
        limit: int = Query(50, ge=1, le=200),
        before: str | None = None,
    ) -> dict[str, Any]:
        """Newest first (capture time). ``q``: an FTS5 query over the text (words, "a phrase",
        prefix*, AND/OR/NOT); ``next`` is the ``before`` of the following page."""
        try:
            events, cursor = store.list_events(
                camera=camera or None,
                since=parse_time(since, "since"),
                until=parse_time(until, "until"),
                q=q.strip() if q and q.strip() else None,
                limit=limit,
                before=parse_cursor(before),
            )
        except QueryError as exc:
            raise UIError(
                400, f"q: not a valid search: {exc}", param="q", code="bad_query"
            ) from None
        nxt = f"{cursor[0]!r}_{cursor[1]}" if cursor else None
        return {"object": "list", "data": events, "next": nxt}

    @api.get("/events/stream")
    async def stream(
        request: Request,
        after: int | None = Query(None, ge=0),
        last_event_id: str | None = Header(None),
    ) -> StreamingResponse:
        """Server-sent events: ``event: event`` with the event as JSON, ``id:`` its seq.
        Starts after ``after`` (or ``Last-Event-ID``), else with the next new event."""
        start = after
        if start is None and last_event_id and last_event_id.isdigit():
            start = int(last_event_id)
        if start is None:
            start = await asyncio.to_thread(store.max_seq)
        heartbeat = config.ui.sse_heartbeat_s

        async def events() -> AsyncIterator[str]:
            last = start
            yield "retry: 2000\n\n"
            while True:
                token = notifier.token()
                rows = await asyncio.to_thread(store.after, last, 100)
                for row in rows:
                    last = row["seq"]
                    yield f"id: {last}\nevent: event\ndata: {json.dumps(row)}\n\n"
                if rows:
                    continue
                if await request.is_disconnected():
                    return
                if not await notifier.wait(token, heartbeat):
                    yield ": keep-alive\n\n"  # also re-reads the store: other writers

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"x-accel-buffering": "no"}
        )

    @api.get("/events/{event_id}")
    def get_event(event_id: str) -> dict[str, Any]:
        event = store.get(event_id)
        if event is None:
            raise UIError(404, f"no event {event_id!r}", param="id", code="event_not_found")
        event["history"] = store.history(event["seq"])
        return event

    @api.get("/events/{event_id}/snapshot.jpg")
    def snapshot(event_id: str, boxes: int = Query(0, ge=0, le=1)) -> Response:
        """The frame (``boxes=1``: with the detector's boxes drawn, when that could be made)."""
        path = store.snapshot_file(event_id, bool(boxes))
        try:
            data = path.read_bytes() if path is not None else None
        except FileNotFoundError:  # retention deleted it just now
            data = None
        if data is None:
            raise UIError(404, f"no snapshot for event {event_id!r}", code="snapshot_not_found")
        return Response(data, media_type="image/jpeg")

    @api.post("/events/{event_id}/describe")
    async def redescribe(event_id: str) -> dict[str, Any]:
        """Describe the stored frame again through the describer's endpoints (the same pool
        and rules as the workers: least loaded first, a down endpoint is skipped); the new
        text (and, for a camera with a ``response_schema``, its structured fields) replaces
        the description, the previous one is kept in ``history``."""
        from pipelines.describe import structured_fields
        from pipelines.vlm import EndpointUnavailable, FrameRejected, ServerError, frame_request

        row = await asyncio.to_thread(store.row, event_id)
        if row is None:
            raise UIError(404, f"no event {event_id!r}", param="id", code="event_not_found")
        path = await asyncio.to_thread(store.snapshot_file, event_id, False)
        if path is None:
            raise UIError(409, "the event has no stored snapshot", code="snapshot_not_found")
        if not config.describer.model and not all(
            e.model for e in config.describer.endpoint_list()
        ):
            raise UIError(503, "describer.model is not configured", code="vlm_not_configured")
        jpeg = await asyncio.to_thread(path.read_bytes)
        fields = {
            "camera": row["camera"],
            "ts": str(row["ts"]),
            "boxes": row["boxes"],
            "width": str(row["width"] or "?"),
            "height": str(row["height"] or "?"),
        }
        camera = config.camera(row["camera"])
        schema = camera.describer.response_schema if camera is not None else None
        async with redescribe_slots:
            jpeg, prompt = await frame_request(config, jpeg, fields)
            try:
                text, info = await endpoints.get().describe_now(jpeg, prompt, schema)
            except EndpointUnavailable as exc:
                raise UIError(
                    503, f"VLM endpoint unavailable: {exc}", code="vlm_unavailable"
                ) from None
            except (ServerError, FrameRejected) as exc:
                raise UIError(502, f"VLM endpoint failed: {exc}", code="vlm_failed") from None
        # the store keeps the fields of a JSON answer (as for the describer's ``structured``,
        # the same parse); an answer the schema should have shaped but did not is logged
        if schema is not None and structured_fields(text) is None:
            log.warning(kv("structured_answer_invalid", camera=row["camera"], id=event_id))
        event = await asyncio.to_thread(
            store.replace_description, event_id, text, str(info["model"]), time.time()
        )
        if event is None:  # deleted by retention meanwhile
            raise UIError(404, f"no event {event_id!r}", param="id", code="event_not_found")
        event["history"] = await asyncio.to_thread(store.history, event["seq"])
        log.info(
            kv("event_redescribed", id=event_id, camera=row["camera"], endpoint=info["endpoint"])
        )
        return event

    @api.get("/cameras")
    def cameras() -> dict[str, Any]:
        """Each camera's latest event and live numbers (``live``: from the pipeline reading
        it, null when none does; ``queued``: frames waiting for a describer; ``describer_lag_s``:
        capture -> description of its latest description), plus the queue's numbers."""
        latest = store.latest_per_camera()
        ids = [c.id for c in config.cameras]
        ids += sorted(set(latest) - set(ids))
        live_info, redis_latest, per_camera = _live(ids)
        data = [
            {
                "id": cam,
                "configured": config.camera(cam) is not None,
                "latest": latest.get(cam),
                "redis_latest": redis_latest.get(cam),
                **per_camera.get(cam, {"live": None, "queued": None, "describer_lag_s": None}),
            }
            for cam in ids
        ]
        return {
            "object": "list",
            "data": data,
            "redis": live_info,
            "events": {
                "stored": store.count_events(),
                "counters": store.counters(),
                "consumer": {
                    "group": config.events.group,
                    "name": config.events.consumer,
                    "running": consumer.alive,
                    "redis_connected": consumer.connected,
                },
            },
        }

    def _live(
        ids: list[str],
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """What Redis knows now: the queue, each camera's latest description there
        (``latest:`` hash) and its live numbers (``pipelines/events/live.py``). Never fails
        the request: Redis may be down."""
        q = config.queue
        keys = ("frame_uid", "ts", "described_at", "persons")
        try:
            info: dict[str, Any] = {
                "queue": queue_depth(live, q),
                "accounting": accounting(live, q),
                "events_group": None,
            }
            try:
                groups = live.xinfo_groups(q.descriptions_stream)
            except redis.ResponseError:  # no stream yet
                groups = []
            for g in groups:
                name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
                if name == config.events.group:
                    info["events_group"] = {"pending": int(g["pending"]), "lag": g.get("lag")}
            per_camera = {}
            for cam in ids:
                raw = live.hmget(f"{q.latest_prefix}{cam}", list(keys))
                if any(v is not None for v in raw):
                    per_camera[cam] = {
                        k: None if v is None else v.decode() for k, v in zip(keys, raw, strict=True)
                    }
            records = camera_records(live, q, ids)
            queued = queued_per_camera(live, q)
            numbers = {
                cam: {
                    "live": records.get(cam),
                    "queued": queued.get(cam, 0),
                    "describer_lag_s": describer_lag(per_camera.get(cam)),
                }
                for cam in ids
            }
            return info, per_camera, numbers
        except redis.RedisError as exc:
            return {"error": f"redis unavailable ({type(exc).__name__})"}, {}, {}

    app.include_router(api)

    @app.get("/health")
    def health() -> Response:
        """Liveness: 503 once the consumer or retention thread died (restart the process)."""
        if not (consumer.alive and retention.alive):
            return UIError(503, "the event consumer is not running", code="worker_dead").response()
        return JSONResponse({"status": "ok", "redis_connected": consumer.connected})

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
