"""Chat and text completions: OpenAI request -> engine request -> OpenAI response or SSE stream.

One code path per endpoint shape, shared driving of the engine stream (``_drive``), which is
where per-request timings are taken. ``n`` choices are ``n`` engine requests of one
preprocessed prompt; the first is queued alone until its prompt is computed, so the others
find its KV blocks in the prefix cache (and its images in the encoder cache) instead of
prefilling the same prompt ``n`` times. Whatever way a request ends (finished, expired, client gone,
server error) it is logged once and, if it never finished, aborted in the engine so that its KV
blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from engine.structured_output import StructuredOutputsParams
from vision_serve.errors import APIError, bad_request, expired_error, from_engine_error
from vision_serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from vision_serve.media import ClipSource, MediaLoader
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
    VideoPart,
    VideoURLPart,
)
from vision_serve.sampling_defaults import SamplingDefaults
from vision_serve.structured_output import structured_outputs_for
from vision_serve.tool_calls import ToolCallStreamer, ToolPlan, plan_tools, read_output
from vision_serve.tool_calls import template_message as tool_template_message

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
        sampling_defaults: SamplingDefaults | None = None,
    ) -> None:
        self.engine = engine
        # the checkpoint's generation_config.json defaults (--generation-config)
        self.sampling_defaults = sampling_defaults or SamplingDefaults({})
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.media = media
        self.log_requests = log_requests
        self._pending: set[asyncio.Task[None]] = set()
        self._token_texts: TokenTexts | None = None

    @property
    def token_texts(self) -> TokenTexts:
        """Token id -> text and bytes, for logprobs (built on first use: the engine's
        tokenizer, shared by every request)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.engine.tokenizer)
        return self._token_texts

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
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        params = self.sampling_defaults.apply(
            req, _sampling_params(req, req.output_limit, plan.constraint)
        )
        messages = await self._engine_messages(req.messages)
        inputs = _with_tools(_engine_inputs("messages", messages, req), plan)
        return await self._serve(req, raw, "chat", inputs, params)

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        req.check_supported()
        params = self.sampling_defaults.apply(req, _sampling_params(req, req.output_limit))
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
            streams = await self._queue_choices(request_id, inputs, params, req)
        except Exception as exc:
            err = from_engine_error(exc)
            if err.status == 500:
                logger.exception("engine.add_request failed for %s", request_id)
            self._finish(record, arrival, status=err.status, error_code=err.code or err.type)
            err.headers.setdefault("x-request-id", record.header_id)
            raise err from None

        response_id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id
        if req.stream:
            body = self._stream(streams, req, endpoint, response_id, record, arrival)
            return StreamingResponse(
                body,
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-request-id": record.header_id},
            )
        return await self._complete(streams, raw, req, endpoint, response_id, record, arrival)

    async def _queue_choices(
        self,
        request_id: str,
        inputs: Any,
        params: SamplingParams,
        req: SamplingFields,
    ) -> list[AsyncIterator[Any]]:
        """One engine request per choice. With a seed, choice ``i`` samples with ``seed + i``
        (vLLM's rule): reproducible, and the choices differ."""
        if req.n == 1:
            stream = await self.engine.add_request(
                request_id, inputs, params, priority=req.priority, deadline_s=req.max_queue_seconds
            )
            return [stream]
        prompt = await self.engine.process_inputs(inputs, priority=req.priority)
        streams: list[AsyncIterator[Any]] = []
        try:
            for i in range(req.n):
                child = dataclasses.replace(
                    params, seed=None if params.seed is None else params.seed + i
                )
                stream = await self.engine.add_request(
                    _choice_id(request_id, i),
                    prompt,
                    child,
                    priority=req.priority,
                    deadline_s=req.max_queue_seconds,
                )
                if i == 0:  # wait for its prompt's KV: the other choices reuse it
                    outputs = aiter(stream)  # one iterator: a dropped one aborts the request
                    head = await anext(outputs, None)
                    stream = _prepend(head, outputs)
                streams.append(stream)
        except BaseException:
            for i in range(len(streams)):
                self._abort_soon(_choice_id(request_id, i))
            raise
        return streams

    async def _complete(
        self,
        streams: list[AsyncIterator[Any]],
        raw: Request,
        req: SamplingFields,
        endpoint: str,
        response_id: str,
        record: RequestRecord,
        arrival: float,
    ) -> Response:
        """Non-streaming: wait for every choice's final output (or the client leaving), answer
        in one body."""
        request_id = record.id
        counts = [0] * len(streams)
        try:
            finals = await _until_disconnected(
                raw, self._collect_all(streams, record, arrival, counts)
            )
        except ClientDisconnected:
            await self._abort_choices(request_id, len(streams))
            self._finish(record, arrival, status=CLIENT_CLOSED, error_code="client_disconnected")
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:  # APIError, or the engine failing the request after queueing
            err = from_engine_error(exc)
            if err.status == 500:
                logger.exception("request %s failed", request_id)
            if err.code != "expired" or len(streams) > 1:  # an expired one is already retired
                await self._abort_choices(request_id, len(streams))
            self._finish(record, arrival, status=err.status, error_code=err.code)
            err.headers.setdefault("x-request-id", record.header_id)
            raise err from None
        self._finish(record, arrival)
        usage = _usage(finals)
        want_logprobs = req.num_logprobs is not None
        body: ChatCompletion | Completion
        if endpoint == "chat":
            chat_choices = []
            for i, final in enumerate(finals):
                comp = final.outputs[0]
                logprobs = (
                    chat_logprobs(comp.logprobs or [], self.token_texts) if want_logprobs else None
                )
                content, calls, reason = read_output(_tool_plan(req), comp.text, comp.finish_reason)
                chat_choices.append(
                    ChatChoice(
                        index=i,
                        message=ResponseMessage(content=content, tool_calls=calls or None),
                        logprobs=logprobs,
                        finish_reason=reason,
                    )
                )
            body = ChatCompletion(
                id=response_id, model=self.model_name, choices=chat_choices, usage=usage
            )
        else:
            text_choices = []
            for i, final in enumerate(finals):
                comp = final.outputs[0]
                logprobs = (
                    completion_logprobs(comp.logprobs or [], self.token_texts)
                    if want_logprobs
                    else None
                )
                text_choices.append(
                    CompletionChoice(
                        index=i, text=comp.text, logprobs=logprobs, finish_reason=comp.finish_reason
                    )
                )
            body = Completion(
                id=response_id, model=self.model_name, choices=text_choices, usage=usage
            )
        return JSONResponse(body.model_dump(), headers={"x-request-id": record.header_id})

    async def _drive(
        self,
        stream: AsyncIterator[Any],
        record: RequestRecord,
        arrival: float,
        counts: list[int] | None = None,
        index: int = 0,
    ) -> AsyncIterator[Any]:
        """Iterate one choice's engine stream, taking TTFT/ITL at the moment each output is
        handed on, and turn the engine's terminal non-answers (expired, abort) into errors.
        The record holds the first choice's timings and every choice's tokens (``counts``)."""
        last: float | None = None
        counts = counts if counts is not None else [0]
        async for out in stream:
            comp = out.outputs[0]
            counts[index] = len(comp.token_ids)
            record.output_tokens = sum(counts)
            if index != 0:
                yield out
                continue
            record.prompt_tokens = len(out.prompt_token_ids)
            record.image_tokens = out.num_image_tokens
            record.cached_tokens = out.num_cached_tokens
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
        self,
        stream: AsyncIterator[Any],
        record: RequestRecord,
        arrival: float,
        counts: list[int],
        index: int,
    ) -> Any:
        final = None
        async for out in self._drive(stream, record, arrival, counts, index):
            final = out
        if final is None or not final.finished:
            raise APIError(500, "engine stream ended without a result", code="internal_error")
        return final

    async def _collect_all(
        self,
        streams: list[AsyncIterator[Any]],
        record: RequestRecord,
        arrival: float,
        counts: list[int],
    ) -> list[Any]:
        """Every choice's final output, in order; the first failure is raised once all ended."""
        results = await asyncio.gather(
            *(self._collect(s, record, arrival, counts, i) for i, s in enumerate(streams)),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _stream(
        self,
        streams: list[AsyncIterator[Any]],
        req: SamplingFields,
        endpoint: str,
        response_id: str,
        record: RequestRecord,
        arrival: float,
    ) -> AsyncIterator[str]:
        """SSE body, chunk for chunk as OpenAI sends it; choices interleave, each chunk names
        its ``index``."""
        created = int(time.time())
        chunks = _ChunkWriter(endpoint, response_id, created, self.model_name, req.include_usage)
        want_logprobs = req.num_logprobs is not None
        counts = [0] * len(streams)
        finals: list[Any] = [None] * len(streams)
        finished = False
        status, error_code = 200, None
        try:
            if endpoint == "chat":
                for i in range(len(streams)):
                    yield chunks.chat(ChoiceDelta(role="assistant", content=""), index=i)
            drives = [self._drive(s, record, arrival, counts, i) for i, s in enumerate(streams)]
            offsets = [0] * len(streams)  # characters streamed per choice (text_offset)
            plan = _tool_plan(req)
            tools = [ToolCallStreamer(plan) if plan.mode != "none" else None for _ in streams]
            async for i, out in _merge(drives):
                comp = out.outputs[0]
                logprobs = None
                if want_logprobs and comp.delta_logprobs:
                    if endpoint == "chat":
                        logprobs = chat_logprobs(comp.delta_logprobs, self.token_texts)
                    else:
                        logprobs = completion_logprobs(
                            comp.delta_logprobs, self.token_texts, offsets[i]
                        )
                text, calls, reason = comp.delta_text, [], comp.finish_reason
                if tools[i] is not None:  # tool calls: content and delta.tool_calls apart
                    text, calls = tools[i].feed(text, out.finished)
                    reason = tools[i].finish_reason(reason)
                if text or logprobs:
                    yield chunks.content(text, index=i, logprobs=logprobs)
                    offsets[i] += len(text)
                if calls:
                    yield chunks.chat(ChoiceDelta(tool_calls=calls), index=i)
                if out.finished:
                    finals[i] = out
                    yield chunks.finish(reason, index=i)
            finished = True
            if req.include_usage:
                yield chunks.usage(_usage(finals))
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
                for i in range(len(streams)):
                    if finals[i] is None:
                        self._abort_soon(_choice_id(record.id, i))
            self._finish(record, arrival, status=status, error_code=error_code)

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # already finished or engine gone: nothing left to free
            logger.debug("abort of %s ignored", request_id, exc_info=True)

    async def _abort_choices(self, request_id: str, n: int) -> None:
        for i in range(n):
            await self._abort(_choice_id(request_id, i))

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
        clips: list[ClipSource] = []
        clip_slots: list[tuple[list[dict[str, Any]], int]] = []
        for i, msg in enumerate(messages):
            role = "system" if msg.role == "developer" else msg.role
            extra = msg.model_extra or {}
            if msg.content is None and not (role == "assistant" and extra.get("tool_calls")):
                raise bad_request("message content is required", param=f"messages[{i}].content")
            if msg.content is None or isinstance(msg.content, str):
                out.append({"role": role, "content": msg.content or ""})
                tool_template_message(out[-1], extra, i)  # tool_calls / tool_call_id
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
                elif isinstance(part, VideoURLPart | VideoPart):
                    if role != "user":
                        raise bad_request("videos are only allowed in user messages", param)
                    parts.append({"type": "video", "video": None})
                    clips.append(_clip_source(part, param))
                    clip_slots.append((parts, len(parts) - 1))
                elif part.type in ("text", "image_url", "video_url", "video"):  # missing field
                    raise bad_request(f"malformed {part.type} part", param=param)
                else:
                    raise bad_request(
                        f"content part type {part.type!r} is not supported",
                        param=f"{param}.type",
                    )
            out.append({"role": role, "content": parts})
            tool_template_message(out[-1], extra, i)
        if loads or clips:
            images, videos = await self.media.load_media(loads, clips)
            for (parts, k), image in zip(slots, images, strict=True):
                parts[k]["image"] = image
            for (parts, k), clip in zip(clip_slots, videos, strict=True):
                parts[k]["video"] = {"frames": clip.frames, "fps": clip.fps}
        return out


def _clip_source(part: VideoURLPart | VideoPart, param: str) -> ClipSource:
    """A video part as the media loader takes it: a video file, or frame URLs."""
    if isinstance(part, VideoPart):
        return ClipSource(param, frames=list(part.video), fps=part.fps)
    url = part.video_url if isinstance(part.video_url, str) else part.video_url.url
    return ClipSource(param, url=url)


class _ChunkWriter:
    """Formats SSE events for one stream (chat.completion.chunk or text_completion).

    A token's chunk is the front end's whole per-token work besides the socket write, and on a
    2-core box its CPU comes out of the engine's: the fields every chunk repeats are encoded
    once, and a plain text delta skips the response models (pydantic's construction and dump
    were a quarter of the event loop's time with 4 streams). The bytes are those the models
    give (``tests/server/test_chunk_writer.py``)."""

    def __init__(
        self, endpoint: str, response_id: str, created: int, model: str, include_usage: bool
    ) -> None:
        self.endpoint = endpoint
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        head = {
            "id": response_id,
            "object": obj,
            "created": created,
            "model": model,
            "system_fingerprint": None,
        }
        self._head = f'data: {_json(head)[:-1]},"choices":'

    def _event(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> str:
        tail = ""
        if self.include_usage:  # OpenAI sends "usage": null on every chunk but the last
            tail = f',"usage":{_json(usage.model_dump(exclude_none=True)) if usage else "null"}'
        return f"{self._head}{_json(choices)}{tail}}}\n\n"

    def chat(
        self,
        delta: ChoiceDelta,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> str:
        choice = ChunkChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
        )
        dumped = choice.model_dump()
        dumped["delta"] = delta.model_dump(exclude_none=True)
        return self._event([dumped])

    def content(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None) -> str:
        if logprobs is None:  # every token of a plain stream: no models to build
            field = {"delta": {"content": text}} if self.endpoint == "chat" else {"text": text}
            return self._event([{"index": index, **field, "logprobs": None, "finish_reason": None}])
        if self.endpoint == "chat":
            return self.chat(ChoiceDelta(content=text), index=index, logprobs=logprobs)
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs)
        return self._event([choice.model_dump()])

    def finish(self, reason: str | None, index: int = 0) -> str:
        if self.endpoint == "chat":
            return self.chat(ChoiceDelta(), finish_reason=reason, index=index)
        choice = CompletionChoice(index=index, text="", finish_reason=reason)
        return self._event([choice.model_dump()])

    def usage(self, usage: Usage) -> str:
        return self._event([], usage=usage)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _sse(body: dict[str, Any]) -> str:
    return f"data: {_json(body)}\n\n"


def _usage(finals: list[Any]) -> Usage:
    """One prompt (counted once, as OpenAI does for ``n`` choices) and every choice's tokens."""
    first = finals[0]
    prompt = len(first.prompt_token_ids)
    completion = sum(len(out.outputs[0].token_ids) for out in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=first.num_cached_tokens),
    )


def _choice_id(request_id: str, index: int) -> str:
    """The engine id of choice ``index``: the request's own id for the first."""
    return request_id if index == 0 else f"{request_id}-{index}"


async def _prepend(head: Any, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``stream`` with ``head`` (already taken from it) put back in front."""
    if head is not None:
        yield head
        if head.finished:
            return
    async for out in stream:
        yield out


async def _merge(drives: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several choices' outputs as they come, tagged with the choice's index. An
    error in any choice is raised here; the rest are cancelled."""
    if len(drives) == 1:
        async for out in drives[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, drive: AsyncIterator[Any]) -> None:
        try:
            async for out in drive:
                await queue.put((index, out))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
            return
        await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, d)) for i, d in enumerate(drives)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _engine_inputs(key: str, value: Any, req: SamplingFields) -> Any:
    """The engine's input for a request: the bare prompt/messages, or with
    ``mm_processor_kwargs`` a vLLM-style dict, so the bounds reach the engine's image
    preprocessing (which runs off the step loop) and apply to this request's images only."""
    if req.mm_processor_kwargs is None:
        return value
    kwargs = req.mm_processor_kwargs.model_dump(exclude_none=True)
    return {key: value, "mm_processor_kwargs": kwargs}


def _tool_plan(req: SamplingFields) -> ToolPlan:
    """How this request's output is read (``none`` for text completions)."""
    return plan_tools(
        getattr(req, "tools", None),
        getattr(req, "tool_choice", None),
        getattr(req, "parallel_tool_calls", None),
    )


def _with_tools(inputs: Any, plan: ToolPlan) -> Any:
    """The chat inputs with the tools for the chat template (Qwen's ``# Tools`` section)."""
    if plan.template_tools is None:
        return inputs
    if not isinstance(inputs, dict):
        inputs = {"messages": inputs}
    return {**inputs, "chat_template_kwargs": {"tools": plan.template_tools}}


def _sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    forced_tool: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """OpenAI defaults (temperature 1, top_p 1) where the client sent nothing."""
    structured = structured_outputs_for(req, forced_tool)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            min_tokens=req.min_tokens,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.token_logit_bias(),
            logprobs=req.num_logprobs,
            structured_outputs=structured,
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
