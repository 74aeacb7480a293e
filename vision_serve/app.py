"""The FastAPI application: routes, auth, body limit. Logic lives in :mod:`vision_serve.serving`.

``create_app`` takes an already-started engine rather than building one, so the same app runs
under ``vision-serve serve``, in tests (one engine, real uvicorn) and inside other programs.
Whoever created the engine shuts it down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import openmp
from vision_serve.auth import bearer_key_dependency
from vision_serve.errors import APIError, install_error_handlers
from vision_serve.media import MediaLoader
from vision_serve.metrics import ServerMetrics
from vision_serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from vision_serve.sampling_defaults import SamplingDefaults
from vision_serve.serving import OpenAIServing
from vision_serve.settings import ServerSettings
from vision_serve.tokenization import DetokenizeResponse, TokenizeResponse, TokenizeServing


class BodyLimitMiddleware:
    """413 for bodies over the limit, checked on Content-Length and again while reading (a
    chunked upload has no Content-Length). Also stamps the request's arrival time, the start of
    TTFT, before the body is read and parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival_time"] = time.monotonic()
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body exceeds the limit of {self.max_bytes} bytes"

    def _too_large(self) -> JSONResponse:
        return APIError(413, self._message(), code="request_too_large").response()


def create_app(engine: Any, settings: ServerSettings | None = None) -> FastAPI:
    """Build the OpenAI-compatible app around a started engine."""
    settings = settings or ServerSettings()
    served = settings.served_model_name or [engine.model_name]
    metrics = ServerMetrics(engine)
    media = MediaLoader(settings)
    serving = OpenAIServing(
        engine,
        served,
        metrics,
        media,
        log_requests=settings.log_requests,
        sampling_defaults=SamplingDefaults.for_engine(engine),
    )
    tokenizing = TokenizeServing(serving)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # asyncio.to_thread (image decoding, /tokenize's preprocessing) runs torch serially,
        # beside the engine's step loop rather than in a second OpenMP team (engine/openmp.py)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="server-io", initializer=openmp.serial_thread)
        )
        yield
        await media.aclose()

    # the schema is served below, behind the same key as /v1 (it lists every route and field)
    app = FastAPI(
        title="vision-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.serving = serving
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    # outermost (added last): preflights are answered before auth, and every answer, a 401 or
    # a 413 included, carries the CORS headers a browser needs to read it
    app.add_middleware(
        CORSMiddleware,
        allow_origins=settings.allowed_origins,
        allow_methods=settings.allowed_methods,
        allow_headers=settings.allowed_headers,
        allow_credentials=settings.allow_credentials,
    )

    # OpenAI answers a missing or wrong key with type invalid_request_error; so do we
    key_error = partial(APIError, type="invalid_request_error")
    require_key = Depends(bearer_key_dependency(settings.api_key, key_error))
    v1 = APIRouter(prefix="/v1", dependencies=[require_key])

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completion(body, request)

    @v1.get("/models")
    async def models() -> ModelList:
        max_len = getattr(engine, "max_model_len", None)
        return ModelList(data=[ModelCard(id=name, max_model_len=max_len) for name in served])

    app.include_router(v1)

    # vLLM serves these at the root, not under /v1; same key rule
    @app.post("/tokenize", dependencies=[require_key])
    async def tokenize(request: Request) -> TokenizeResponse:
        return await tokenizing.tokenize(request)

    @app.post("/detokenize", dependencies=[require_key])
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await tokenizing.detokenize(request)

    @app.get(
        "/openapi.json",
        include_in_schema=False,
        dependencies=[require_key],
    )
    async def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 only while the model is loaded and the step loop runs (orchestrators
        restart the container otherwise). A full queue is still live: see ``/health/ready``."""
        if engine.is_alive():
            return JSONResponse({"status": "ok"})
        return APIError(503, "engine is not running", code="engine_dead").response()

    @app.get("/health/ready")
    async def ready() -> Response:
        """Readiness (k8s readinessProbe, load balancers): live and the waiting queue has room,
        so a new request would be queued rather than refused with 429."""
        if not engine.is_alive():
            return APIError(503, "engine is not running", code="engine_dead").response()
        has_capacity = getattr(engine, "has_capacity", None)
        if has_capacity is not None and not has_capacity():
            return APIError(503, "the request queue is full", code="queue_full").response()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
