"""The engine for servers: a background step-loop thread, asyncio streams per request.

Callers on any event loop ``await add_request(...)`` (input processing runs in a thread pool,
so decoding a camera frame never blocks the step loop) and iterate the returned stream. The
step thread owns the ``LLMEngine``; other threads talk to it only through a command inbox, so
no engine state is shared without a lock.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.config import EngineArgs
from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import Priority
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

log = logging.getLogger("engine.async")


class RequestStream:
    """Async iterator over one request's outputs; leaving it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:  # called from the step thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self.finished = True
                yield item
                if self.finished:
                    return
        finally:
            if not self.finished:
                self.engine.abort_nowait(self.request_id)


class AsyncEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.engine = LLMEngine(args)
        self.args = args
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stats = self.engine.get_stats()
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, args.preprocess_workers), thread_name_prefix="preprocess"
        )
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        inputs: Any,
        params: SamplingParams | None = None,
        priority: str | Priority | None = "interactive",
        deadline_s: float | None = None,
    ) -> RequestStream:
        """Validate and preprocess, then queue. Raises ``InvalidRequestError`` subclasses or
        ``QueueFullError`` here, before the caller has streamed anything."""
        self._check_alive()
        params = params or SamplingParams()
        parsed_priority = Priority.parse(priority)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self._pool, self.engine.process_inputs, inputs)
        self.engine.validate(prompt, params)
        limit = self.args.max_queue_len
        if limit and self._stats.num_waiting + self._inbox.qsize() >= limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests)")
        stream = RequestStream(self, request_id, loop)
        self._streams[request_id] = stream
        self._post("add", (request_id, prompt, params, parsed_priority, deadline_s))
        return stream

    async def generate(
        self,
        request_id: str,
        inputs: Any,
        params: SamplingParams | None = None,
        priority: str | Priority | None = "interactive",
        deadline_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, inputs, params, priority, deadline_s)
        async for out in stream:
            yield out

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        self._post("abort", request_id)

    def get_stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- step thread ----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine step loop died: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("engine is shutting down")

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, prompt, params, priority, deadline_s = payload
                stream = self._streams.get(request_id)
                try:
                    self.engine.add_processed(request_id, prompt, params, priority, deadline_s)
                except (InvalidRequestError, QueueFullError) as exc:
                    self._streams.pop(request_id, None)
                    if stream:
                        stream.put(exc)
            elif kind == "abort":
                out = self.engine.abort(payload)
                stream = self._streams.pop(payload, None)
                if stream is not None and out is not None:
                    stream.put(out)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.get_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if not outputs and self.engine.last_step_idle:
                    time.sleep(0.001)  # nothing schedulable yet (e.g. KV full): don't spin
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    stream.put(out)
                self._stats = self.engine.get_stats()
        except BaseException as exc:
            log.exception("engine step loop died")
            self._dead = exc
            dead = EngineDeadError(f"engine step loop died: {exc!r}")
            for stream in list(self._streams.values()):
                stream.put(dead)
            self._streams.clear()
