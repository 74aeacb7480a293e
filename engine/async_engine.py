"""The engine for servers: a background step-loop thread, asyncio streams per request.

Callers on any event loop ``await add_request(...)`` (input processing runs in a thread pool,
so decoding a camera frame never blocks the step loop) and iterate the returned stream. The
step thread owns the ``LLMEngine``; other threads talk to it only through a command inbox, so
no engine state is shared without a lock.

Failure containment: an exception while the step thread handles *one* request (admitting it,
aborting it, handing it an output) fails that request's stream only and the loop goes on. An
exception from the batched step itself cannot be pinned on one request: the loop dies, every
open stream and every later request gets ``EngineDeadError`` at once (never a hang), and the
death callbacks run so that the server can exit and a supervisor restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine import openmp
from engine.config import EngineArgs
from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import Priority, ProcessedPrompt
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

log = logging.getLogger("engine.async")

# nice value of the threads preprocessing batch (camera) requests: at 10 a busy one gets ~10 %
# of a core the step loop's threads want, and all of an idle one
BATCH_PREPROCESS_NICENESS = 10


def lower_thread_priority(niceness: int) -> None:
    """Lower the calling thread's CPU priority (Linux: ``setpriority`` on a thread id applies
    to that thread alone). Best effort: elsewhere, or where refused, the thread keeps its
    priority and only the scheduling advantage is lost."""
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(current, niceness))
    except (AttributeError, OSError) as exc:
        log.debug("could not lower the preprocessing thread's priority: %s", exc)


def _batch_preprocess_thread() -> None:
    lower_thread_priority(BATCH_PREPROCESS_NICENESS)
    openmp.serial_thread()


class RequestStream:
    """Async iterator over one request's outputs; leaving it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

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


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """On the streams' event loop: queue the items, in order."""
    for stream, out in batch:
        stream.queue.put_nowait(out)


class AsyncEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.engine = LLMEngine(args)
        # the step loop's OpenMP team is to be the only one (engine/openmp.py): this thread's,
        # left idle by loading and calibrating, would make every team sleep at each barrier
        openmp.release_team()
        self.args = args
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        # adds posted but not yet drained: they count against --max-queue-len (aborts do not)
        self._pending_adds = 0
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stats = self.engine.get_stats()
        workers = max(1, args.preprocess_workers)
        # preprocessing runs torch serially: a team of its own would throttle the step loop's
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="preprocess", initializer=openmp.serial_thread
        )
        # camera frames are decoded at a lower OS priority: on a 2-core box three of them
        # arriving together took both cores from the step loop for 100-150 ms and every chat
        # stream's tokens waited with it. Interactive images keep the normal priority (their
        # preprocessing is part of someone's TTFT).
        self._batch_pool = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="preprocess-batch",
            initializer=_batch_preprocess_thread,
        )
        self._stopping = False
        self._dead: BaseException | None = None
        # Orders stream registration against the death sweep: a stream is either in _streams
        # when the loop dies (and is failed by the sweep) or sees _dead when registering.
        self._lock = threading.Lock()
        self._death_callbacks: list[Callable[[BaseException], None]] = []
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
        """Validate and preprocess, then queue. Raises ``InvalidRequestError`` subclasses,
        ``QueueFullError`` or ``EngineDeadError`` here, before the caller has streamed anything.

        The id is reserved before the (awaited) preprocessing, so two concurrent calls with one
        id cannot both pass the check and then overwrite each other's stream."""
        params = params or SamplingParams()
        parsed_priority = Priority.parse(priority)
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        # admission before work: a full queue refuses before any image is decoded (and again
        # after, since others may have filled it meanwhile)
        self._check_capacity()
        with self._lock:
            self._check_alive()
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        try:
            # off the loop: preprocessing decodes images, and validation compiles a new
            # structured-output grammar (~0.1-0.3 s on a 151k vocabulary)
            pool = self._pool_for(parsed_priority)
            prompt = await loop.run_in_executor(pool, self._prepare, inputs, params)
            self._check_capacity()
            with self._lock:  # the loop may have died while we were preprocessing
                self._check_alive()
                self._post("add", (request_id, prompt, params, parsed_priority, deadline_s))
                if parsed_priority is Priority.INTERACTIVE:
                    self.engine.step_interrupt.request()  # a batch-only step gives way now
        except BaseException:
            with self._lock:
                if self._streams.get(request_id) is stream:
                    self._streams.pop(request_id, None)
            raise
        return stream

    def _prepare(self, inputs: Any, params: SamplingParams) -> ProcessedPrompt:
        """Preprocess (unless already done: the ``n`` choices of one prompt) and validate."""
        prompt = (
            inputs if isinstance(inputs, ProcessedPrompt) else self.engine.process_inputs(inputs)
        )
        self.engine.validate(prompt, params)
        return prompt

    async def process_inputs(
        self, inputs: Any, priority: str | Priority | None = "interactive"
    ) -> ProcessedPrompt:
        """Tokenise and preprocess once, off the loop, for a caller that queues several
        requests of one prompt (``n`` choices): ``add_request`` takes the result as inputs."""
        self._check_capacity()
        loop = asyncio.get_running_loop()
        pool = self._pool_for(Priority.parse(priority))
        return await loop.run_in_executor(pool, self.engine.process_inputs, inputs)

    def _pool_for(self, priority: Priority) -> ThreadPoolExecutor:
        return self._batch_pool if priority is Priority.BATCH else self._pool

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

    def has_capacity(self) -> bool:
        """Whether a new request would be queued rather than refused with ``QueueFullError``
        (readiness: a load balancer should send work elsewhere while this is false)."""
        limit = self.args.max_queue_len
        return not limit or self._stats.num_waiting + self._pending_adds < limit

    def _check_capacity(self) -> None:
        if not self.has_capacity():
            raise QueueFullError(f"waiting queue is full ({self.args.max_queue_len} requests)")

    def add_death_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(exc)`` (on the step thread) if the step loop dies, or now if it
        already has. A server uses it to exit so that its supervisor restarts it: a process
        that stays up with a dead engine only answers 503."""
        with self._lock:
            dead = self._dead
            if dead is None:
                self._death_callbacks.append(callback)
        if dead is not None:
            callback(dead)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # a step still running keeps its trace open
            self.engine.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._batch_pool.shutdown(wait=False, cancel_futures=True)

    # ---- step thread ----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine step loop died: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("engine is shutting down")

    def _post(self, kind: str, payload: Any) -> None:
        if kind == "add":
            with self._pending_lock:
                self._pending_adds += 1
        self._inbox.put((kind, payload))
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._pending_lock:
                    self._pending_adds -= 1
                request_id, prompt, params, priority, deadline_s = payload
                try:
                    self.engine.add_processed(request_id, prompt, params, priority, deadline_s)
                except (InvalidRequestError, QueueFullError) as exc:
                    self._fail_request(request_id, exc)
                except Exception as exc:  # e.g. building its generator: this request only
                    log.exception("request %s failed on admission; engine continues", request_id)
                    self._discard(request_id)
                    self._fail_request(request_id, exc)
            elif kind == "abort":
                try:
                    out = self.engine.abort(payload)
                except Exception:
                    log.exception("abort of %s failed; engine continues", payload)
                    self._discard(payload)
                    out = None
                stream = self._streams.pop(payload, None)
                if stream is not None and out is not None:
                    self._put(stream, out)

    def _discard(self, request_id: str) -> None:
        """Drop whatever a half-admitted or failed request left in the engine."""
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("could not abort %s after its failure", request_id)
        self.engine.detokenizers.pop(request_id, None)

    def _fail_request(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._put(stream, exc)

    def _put(self, stream: RequestStream, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to a stream; False if its event loop is gone (the caller left)."""
        return self._send(stream.loop, [(stream, item)])

    def _send(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[tuple[RequestStream, RequestOutput | BaseException]],
    ) -> bool:
        """Queue ``batch`` on ``loop`` in one wake-up; False if that loop is gone."""
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # "Event loop is closed": its callers left
            for stream, _ in batch:
                log.warning("request %s: its event loop is closed; dropping it", stream.request_id)
            return False
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one per
        stream (each ``call_soon_threadsafe`` is a handle and a wake-up on the step thread and
        the loop). Under uvloop, which coalesces wake-ups itself, it measured inside the noise
        (event loop 130-138 against 133-208 us a streamed token, 4 streams,
        ``benchmarks.front_end_cpu``); it is kept because it costs nothing and asyncio's own
        loop (tests, embedders) writes a byte to its self-pipe per call."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._streams.pop(out.request_id, None)
            batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            if self._send(loop, batch):
                continue
            for stream, out in batch:
                if not out.finished:
                    self._streams.pop(stream.request_id, None)
                    self._discard(stream.request_id)

    def _run(self) -> None:
        try:
            while not self._stopping:
                # lowered before the drain: a chat queued after it raises the flag again for
                # the coming step; one queued before it is in that step's view of the engine
                self.engine.step_interrupt.clear()
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.get_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                if not outputs and self.engine.last_step_idle:
                    time.sleep(0.001)  # nothing schedulable yet (e.g. KV full): don't spin
                # stats first: a client handed its answer (or its 408) must find the queue
                # without it, or its next request could be refused as if it still waited
                self._stats = self.engine.get_stats()
                self._deliver(outputs)
        except BaseException as exc:
            log.exception("engine step loop died")
            self._die(exc)
        else:
            self._fail_open_streams(EngineDeadError("engine is shutting down"))

    def _fail_open_streams(self, error: EngineDeadError) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            self._put(stream, error)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            callbacks = list(self._death_callbacks)
        self._fail_open_streams(EngineDeadError(f"engine step loop died: {exc!r}"))
        for callback in callbacks:
            try:
                callback(exc)
            except Exception:
                log.exception("engine death callback failed")
