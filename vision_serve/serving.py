"""Chat and text completions: OpenAI request -> engine request -> OpenAI response or SSE stream.

One code path per endpoint shape, shared driving of the engine stream (``_drive``), which is
where per-request timings are taken. Whatever way a request ends (finished, expired, client gone,
server error) it is logged once and, if it never finished, aborted in the engine so that its KV
blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from vision_serve.errors import APIError, bad_request, expired_error, from_engine_error
from vision_serve.media import MediaLoader
from vision_serve.metrics import RequestRecord, ServerMetrics, fill_engine_timings
from vision_serve.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    ChoiceDelta,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ImagePart,
    PromptTokensDetails,
    ResponseMessage,
    SamplingFields,
    TextPart,
    Usage,
)

logger = logging.getLogger("vision_serve.serving")

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's convention for "client went away before the response"


class ClientDisconnected(Exception):
    """The HTTP client closed the connection while we were still computing its answer."""


class OpenAIServing:
    """Holds the engine and the per-app helpers; one instance per app."""

    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        metrics: ServerMetrics,
        media: MediaLoader,
        log_requests: bool = True,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.media = media
        self.log_requests = log_requests
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str) -> None:
        if name not in self.served_model_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist. Served: {', '.join(self.served_model_names)}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    # -- endpoints -----------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        req.check_supported()
        params = _sampling_params(req, req.output_limit)
        messages = await self._engine_messages(req.messages)
        inputs = _engine_inputs("messages", messages, req)
        return await self._serve(req, raw, "chat", inputs, params)

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        req.check_supported()
        params = _sampling_params(req, req.output_limit)
        prompt = req.prompt_text()
        inputs = _engine_inputs("prompt", prompt, req)
        return await self._serve(req, raw, "completions", inputs, params)

    # -- shared --------------------------------------------------------------------------------

    async def _serve(
        self,
        req: SamplingFields,
        raw: Request,
        endpoint: str,
        inputs: str | list[dict[str, Any]] | dict[str, Any],
        params: SamplingParams,
    ) -> Response:
        arrival = getattr(raw.state, "arrival_time", None) or time.monotonic()
        # The engine's id is always ours: a client's x-request-id need not be unique (retries,
        # proxies), and two requests sharing an engine id would share one output stream.
        request_id = uuid.uuid4().hex
        record = RequestRecord(
            id=request_id,
            endpoint=endpoint,
            priority=req.priority,
            stream=req.stream,
            client_request_id=raw.headers.get("x-request-id") or None,
            user=req.user,
        )
        try:
            stream = await self.engine.add_request(
                request_id,
                inputs,
                params,
                priority=req.priority,
                deadline_s=req.max_queue_seconds,
            )
        except Exception as exc:
            err = from_engine_error(exc)
            if err.status == 500:
                logger.exception("engine.add_request failed for %s", request_id)
            self._finish(record, arrival, status=err.status, error_code=err.code or err.type)
            err.headers.setdefault("x-request-id", record.header_id)
            raise err from None

        response_id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id
        if req.stream:
            body = self._stream(stream, req, endpoint, response_id, record, arrival)
            return StreamingResponse(
                body,
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-request-id": record.header_id},
            )
        return await self._complete(stream, raw, endpoint, response_id, record, arrival)

    async def _complete(
        self,
        stream: AsyncIterator[Any],
        raw: Request,
        endpoint: str,
        response_id: str,
        record: RequestRecord,
        arrival: float,
    ) -> Response:
        """Non-streaming: wait for the final output (or the client leaving), answer in one body."""
        request_id = record.id
        try:
            final = await _until_disconnected(raw, self._collect(stream, record, arrival))
        except ClientDisconnected:
            await self._abort(request_id)
            self._finish(record, arrival, status=CLIENT_CLOSED, error_code="client_disconnected")
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:  # APIError, or the engine failing the request after queueing
            err = from_engine_error(exc)
            if err.status == 500:
                logger.exception("request %s failed", request_id)
            if err.code != "expired":
                await self._abort(request_id)
            self._finish(record, arrival, status=err.status, error_code=err.code)
            err.headers.setdefault("x-request-id", record.header_id)
            raise err from None
        self._finish(record, arrival)
        usage = _usage(final)
        text = final.outputs[0].text
        reason = final.outputs[0].finish_reason
        body: ChatCompletion | Completion
        if endpoint == "chat":
            message = ResponseMessage(content=text)
            body = ChatCompletion(
                id=response_id,
                model=self.model_name,
                choices=[ChatChoice(message=message, finish_reason=reason)],
                usage=usage,
            )
        else:
            body = Completion(
                id=response_id,
                model=self.model_name,
                choices=[CompletionChoice(text=text, finish_reason=reason)],
                usage=usage,
            )
        return JSONResponse(body.model_dump(), headers={"x-request-id": record.header_id})

    async def _drive(
        self, stream: AsyncIterator[Any], record: RequestRecord, arrival: float
    ) -> AsyncIterator[Any]:
        """Iterate the engine stream, taking TTFT/ITL at the moment each output is handed on,
        and turn the engine's terminal non-answers (expired, abort) into errors."""
        last: float | None = None
        async for out in stream:
            comp = out.outputs[0]
            record.prompt_tokens = len(out.prompt_token_ids)
            record.image_tokens = out.num_image_tokens
            record.cached_tokens = out.num_cached_tokens
            record.output_tokens = len(comp.token_ids)
            record.finish_reason = comp.finish_reason
            if out.finished:
                fill_engine_timings(record, out.metrics)
            if comp.finish_reason == "expired":
                raise expired_error(record.id)
            if comp.finish_reason == "abort":
                raise APIError(503, "request was aborted by the server", code="aborted")
            now = time.monotonic()
            if comp.delta_token_ids:
                if last is None:
                    record.ttft_s = now - arrival
                else:
                    record.itl_s.append(now - last)
                last = now
            yield out

    async def _collect(
        self, stream: AsyncIterator[Any], record: RequestRecord, arrival: float
    ) -> Any:
        final = None
        async for out in self._drive(stream, record, arrival):
            final = out
        if final is None or not final.finished:
            raise APIError(500, "engine stream ended without a result", code="internal_error")
        return final

    async def _stream(
        self,
        stream: AsyncIterator[Any],
        req: SamplingFields,
        endpoint: str,
        response_id: str,
        record: RequestRecord,
        arrival: float,
    ) -> AsyncIterator[str]:
        """SSE body, chunk for chunk as OpenAI sends it."""
        created = int(time.time())
        chunks = _ChunkWriter(endpoint, response_id, created, self.model_name, req.include_usage)
        finished = False
        status, error_code = 200, None
        try:
            if endpoint == "chat":
                yield chunks.chat(ChoiceDelta(role="assistant", content=""))
            async for out in self._drive(stream, record, arrival):
                comp = out.outputs[0]
                if comp.delta_text:
                    yield chunks.content(comp.delta_text)
                if out.finished:
                    finished = True
                    yield chunks.finish(comp.finish_reason)
                    if req.include_usage:
                        yield chunks.usage(_usage(out))
            yield "data: [DONE]\n\n"
        except APIError as err:
            status, error_code = err.status, err.code
            finished = err.code == "expired"  # the engine already retired it
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status, error_code = CLIENT_CLOSED, "client_disconnected"
            raise
        except Exception as exc:  # the engine failing the request after it was queued
            err = from_engine_error(exc)
            if err.status == 500:
                logger.exception("stream %s failed", record.id)
            status, error_code = err.status, err.code
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                # Not awaited: under Starlette's cancel scope every await here would be
                # cancelled again, and the abort must happen regardless.
                self._abort_soon(record.id)
            self._finish(record, arrival, status=status, error_code=error_code)

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # already finished or engine gone: nothing left to free
            logger.debug("abort of %s ignored", request_id, exc_info=True)

    def _abort_soon(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(request_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _finish(
        self,
        record: RequestRecord,
        arrival: float,
        status: int = 200,
        error_code: str | None = None,
    ) -> None:
        record.status = status
        record.error_code = error_code
        record.e2e_s = time.monotonic() - arrival
        self.metrics.observe(record)
        if self.log_requests:
            self.metrics.log(record)

    # -- inputs --------------------------------------------------------------------------------

    async def _engine_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """OpenAI messages -> engine messages with every image already loaded (or a 400)."""
        out: list[dict[str, Any]] = []
        loads: list[tuple[str, str]] = []
        slots: list[tuple[list[dict[str, Any]], int]] = []
        for i, msg in enumerate(messages):
            role = "system" if msg.role == "developer" else msg.role
            if role == "tool":
                raise bad_request("tool messages are not supported", param=f"messages[{i}].role")
            if msg.content is None:
                raise bad_request("message content is required", param=f"messages[{i}].content")
            if isinstance(msg.content, str):
                out.append({"role": role, "content": msg.content})
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(msg.content):
                param = f"messages[{i}].content[{j}]"
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                elif isinstance(part, ImagePart):
                    if role != "user":
                        raise bad_request("images are only allowed in user messages", param)
                    url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
                    parts.append({"type": "image", "image": None})
                    loads.append((url, f"{param}.image_url"))
                    slots.append((parts, len(parts) - 1))
                elif part.type in ("text", "image_url"):  # the right type, missing its field
                    raise bad_request(f"malformed {part.type} part", param=param)
                else:
                    raise bad_request(
                        f"content part type {part.type!r} is not supported",
                        param=f"{param}.type",
                    )
            out.append({"role": role, "content": parts})
        if loads:
            images = await self.media.load_all(loads)
            for (parts, k), image in zip(slots, images, strict=True):
                parts[k]["image"] = image
        return out


class _ChunkWriter:
    """Formats SSE events for one stream (chat.completion.chunk or text_completion)."""

    def __init__(
        self, endpoint: str, response_id: str, created: int, model: str, include_usage: bool
    ) -> None:
        self.endpoint = endpoint
        self.id = response_id
        self.created = created
        self.model = model
        self.include_usage = include_usage

    def _event(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> str:
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:  # OpenAI sends "usage": null on every chunk but the last
            body["usage"] = usage.model_dump(exclude_none=True) if usage else None
        return _sse(body)

    def chat(self, delta: ChoiceDelta, finish_reason: str | None = None) -> str:
        choice = ChunkChoice(delta=delta, finish_reason=finish_reason)
        dumped = choice.model_dump()
        dumped["delta"] = delta.model_dump(exclude_none=True)
        return self._event([dumped])

    def content(self, text: str) -> str:
        if self.endpoint == "chat":
            return self.chat(ChoiceDelta(content=text))
        return self._event([CompletionChoice(text=text).model_dump()])

    def finish(self, reason: str | None) -> str:
        if self.endpoint == "chat":
            return self.chat(ChoiceDelta(), finish_reason=reason)
        return self._event([CompletionChoice(text="", finish_reason=reason).model_dump()])

    def usage(self, usage: Usage) -> str:
        return self._event([], usage=usage)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _usage(out: Any) -> Usage:
    prompt = len(out.prompt_token_ids)
    completion = len(out.outputs[0].token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
    )


def _engine_inputs(key: str, value: Any, req: SamplingFields) -> Any:
    """The engine's input for a request: the bare prompt/messages, or with
    ``mm_processor_kwargs`` a vLLM-style dict, so the bounds reach the engine's image
    preprocessing (which runs off the step loop) and apply to this request's images only."""
    if req.mm_processor_kwargs is None:
        return value
    kwargs = req.mm_processor_kwargs.model_dump(exclude_none=True)
    return {key: value, "mm_processor_kwargs": kwargs}


def _sampling_params(req: SamplingFields, max_tokens: int | None) -> SamplingParams:
    """OpenAI defaults (temperature 1, top_p 1) where the client sent nothing."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_tokens=req.min_tokens,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
        )
    except InvalidRequestError as exc:
        raise from_engine_error(exc) from None


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` but give up (cancelling it) as soon as the HTTP client disconnects, so a
    non-streaming request whose caller is gone stops costing engine steps."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected
