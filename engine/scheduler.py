"""Stall-free (Sarathi-Serve) scheduling: one budget per step, decodes first.

There are no prefill and decode phases: every request has ``num_computed_tokens`` and a target
(``num_tokens``), and each step tops requests up under one :class:`StepBudget` (tokens, and by
default the step's predicted seconds; see ``engine/step_budget.py``):

1. running decodes get one token each (interactive before batch);
2. the rest of the budget goes to prompt chunks — of running requests whose prompt is part
   done, and of waiting requests — interactive before batch, first come first served within
   a class; batch work beside active interactive work gets the ITL target at most. A chunk
   may end inside an image's placeholder range; an image's encoding is advanced under the
   same budget, and a chunk stops before an image whose embeddings are not ready.

All policy lives here; the KV-cache and encoder-cache managers only keep accounts, and the
model runner only executes the plain :class:`SchedulerOutput` it is given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.cost_model import StepCostModel, StepFeatures
from engine.encoder_cache import EncoderCacheManager
from engine.kv_cache_manager import KVCacheManager
from engine.request import Priority, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.step_budget import BesideChatPace, StepBudget, StepLimits
from engine.structured_output import GrammarState


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of one request, computed this step."""

    request_id: str
    start: int
    num_tokens: int
    token_ids: list[int]
    # [3, num_tokens] M-RoPE positions; None for a generated token, whose ``text_position``
    # says it all (read both through ``position_ids``)
    positions: torch.Tensor | None
    block_table: list[int]
    # (content hash, first embedding row, end row, row offset inside this chunk)
    image_slices: list[tuple[str, int, int, int]]
    sample: bool  # the chunk reaches the end of the sequence: sample the next token
    is_decode: bool
    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int]  # tokens generated so far (for min_tokens / penalties)
    prompt_token_ids: list[int] = field(default_factory=list)  # for the repetition penalty
    grammar: GrammarState | None = None  # constrained decoding: masks this chunk's sampled row
    # a generated token's position (all three M-RoPE axes equal), else None: the fused decode
    # step looks its rotary angles up by it instead of computing them from ``positions``
    text_position: int | None = None

    def position_ids(self) -> torch.Tensor:
        """[3, num_tokens] M-RoPE positions."""
        if self.positions is not None:
            return self.positions
        assert self.text_position is not None and self.num_tokens == 1
        return torch.full((3, 1), self.text_position, dtype=torch.long)


@dataclass
class EncoderJob:
    content_hash: str
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first
    encoder_jobs: list[EncoderJob] = field(default_factory=list)  # jobs to start this step
    # work per encoding job this step, in patch-block units (inf: run it to completion)
    encoder_work: dict[str, float] = field(default_factory=dict)
    # what one more vision work item costs beyond its FLOPs, in the same units (the cost
    # model's per-item price over its per-unit price; 0 until it has learnt one)
    encoder_item_overhead: float = 0.0
    evicted_encoder_hashes: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)
    features: StepFeatures = field(default_factory=StepFeatures)  # what the cost model sees
    predicted_s: float | None = None  # the cost model's estimate when a target was applied
    target_s: float | None = None  # the time limit this step was sized for (None: tokens only)
    # interactive streams decode in this step: the server streams their tokens between steps
    # (the runner then leaves a CPU core to that front end while it encodes images)
    interactive_decodes: bool = False
    held_decodes: int = 0  # batch decodes held out of an encoder-only step (_hold_batch_decodes)
    # no interactive work in the engine: the runner may give the step up at its safe points
    # when a chat request is queued (engine/step_interrupt.py); its prompt rows run eager
    interruptible: bool = False
    # no interactive work in the engine and image encoding in the step: the runner stops the
    # encoding between items when a chat request is queued and skips the step's forward (its
    # chunks run again), whether or not the step is ``interruptible`` (see Scheduler.schedule)
    encoding_interruptible: bool = False
    # batch work sized under the ITL target beside interactive decodes: how this step runs
    # against its prediction paces the next such steps (Scheduler.observe_step)
    paced: bool = False
    # predicted seconds of a step with the interactive decodes alone: the part of the step
    # chat would take without camera work (the step trace's share measure; None: none, or no
    # fitted cost model)
    chat_decode_s: float | None = None

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.encoder_jobs and not self.encoder_work


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # time limits on a step's predicted duration (engine/step_budget.py); default: none, the
    # token budget alone sizes steps
    target_itl_s: float | str | None = None
    max_step_s: float | str | None = None
    auto_target_factor: float = 1.25
    # starvation guard: most steps in a row a prefill is held back by the time limit, or a
    # camera decode sits out an encoder-only step (_hold_batch_decodes)
    max_deferred_steps: int = 16
    # stall-free encoding: image encoding is advanced under the step budget, not run whole
    enable_chunked_encoder: bool = True
    # FLOP-based token equivalent of one encoder unit, until the cost model calibrates it
    encoder_unit_tokens: float = 0.01
    # decode-only steps of up to this many rows run the fused CPU kernel (0: no kernel)
    fused_decode_rows: int = 0
    # steps with prompt tokens run it too, up to this many rows in all (0: never)
    fused_prefill_rows: int = 0
    # its linears run its own GEMV up to this many rows, oneDNN's GEMM past them (0: no switch)
    fused_gemv_rows: int = 0
    # safe points of an interruptible step (StepLimits.interrupt_points); 0: none is
    interrupt_points: int = 0

    @property
    def limits(self) -> StepLimits:
        return StepLimits(
            max_tokens=self.max_num_batched_tokens,
            target_itl_s=self.target_itl_s,
            max_step_s=self.max_step_s,
            auto_itl_factor=self.auto_target_factor,
            interrupt_points=self.interrupt_points,
        )


def _rank(req: Request) -> tuple[int, float]:
    """Scheduling order: class first, then arrival (FCFS within a class)."""
    return (int(req.priority), req.arrival_time)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        encoder_cache: EncoderCacheManager,
        clock: Callable[[], float] = time.monotonic,
        cost_model: StepCostModel | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.encoder_cache = encoder_cache
        self.clock = clock
        self.cost_model = cost_model or StepCostModel()
        self.last_target_s: float | None = None
        self.last_prefill_budget = config.max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_expired = 0
        self.num_aborted = 0
        # the last step with interactive work in the engine (see _quiet_since_chat)
        self.last_interactive_time = -math.inf
        self.pace = BesideChatPace()

    # ---- queue management -----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop string, abort ...) and free everything it holds at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if status is RequestStatus.FINISHED_ABORTED:
            self.num_aborted += 1
        self._free(req)
        req.metrics.finished_time = self.clock()
        return req

    def _free(self, req: Request, keep_encodings: bool = False) -> None:
        self.kv.free(req.request_id)
        self.encoder_cache.release_request(
            req.request_id, [im.content_hash for im in req.prompt.images], keep_encodings
        )

    # ---- the policy -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock()
        self._expire_stale(out, now)
        budget = self.new_budget()
        scheduled: set[str] = set()

        # 1. decodes, one token each, best class first
        interactive_decoding = False
        chat_contexts: list[int] = []
        for req in sorted((r for r in self.running if not r.is_prefill), key=_rank):
            if budget.tokens_left < 1:
                break
            if req.request_id in out.preempted_ids:
                continue
            if not self._reserve(req, 1, scheduled, out):
                continue
            budget.add_decode(req.num_computed_tokens + 1)
            self._emit(req, 1, out, now)
            scheduled.add(req.request_id)
            if req.priority is Priority.INTERACTIVE:
                interactive_decoding = True
                chat_contexts.append(req.num_computed_tokens + 1)

        # 2. prompt chunks: running part-done prompts and waiting requests, best class first;
        #    a waiting interactive request outranks a half-done batch prefill. The time limit
        #    is the step bound (none for chat prompts while no chat decodes: nobody to stall);
        #    batch work next to active interactive work gets the ITL target at most (without
        #    a step bound, interactive prompts get it too). Under time-sized steps no batch
        #    prompt chunk or encoder piece joins a step that carries an interactive prompt's
        #    chunk or its image's encoding: in the step after a camera step gave way to a
        #    chat, a camera encoder piece beside the chat's prompt ran 1-11 ms (its price was
        #    the ITL target's leftovers, its time a cold piece's) and the chat's first token
        #    waited for it (2-core AMX Xeon, benchmarks.interactive_first step traces).
        candidates = [r for r in self.running if r.is_prefill and r.request_id not in scheduled]
        candidates += self.waiting
        interactive_prompts = any(r.priority is Priority.INTERACTIVE for r in candidates)
        interactive_active = interactive_decoding or any(
            r.priority is Priority.INTERACTIVE for r in self.running + self.waiting
        )
        if interactive_active:
            self.last_interactive_time = now
        budget.open_prefill(
            interactive_decoding,
            interactive_prompts,
            interruptible=not interactive_active and self._quiet_since_chat(budget, now),
        )
        prefill_scheduled = False
        prefill_tokens = 0
        restricted = False
        interactive_prompt_work = False
        progressed: set[Priority] = set()  # classes that got prompt work in this step
        prefill_tokens_batch = 0
        for req in sorted(candidates, key=_rank):
            if budget.tokens_left < 1:
                break
            if interactive_prompt_work and req.priority is not Priority.INTERACTIVE:
                break  # nothing batch in a chat prompt's step: its first token waits for none
            if interactive_active and req.priority is Priority.BATCH and not restricted:
                budget.restrict_to_itl()
                restricted = True
            if req.status is RequestStatus.PREEMPTED and req.request_id in out.preempted_ids:
                continue  # preempted in this very step; its turn comes next step
            is_waiting = req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if is_waiting and len(self.running) >= self.config.max_num_seqs:
                continue
            cached_blocks: list[int] = []
            if is_waiting and req.num_computed_tokens == 0:
                cached_blocks = self._cached_prefix(req)
            computed = max(req.num_computed_tokens, len(cached_blocks) * self.kv.block_size)
            n = self._chunk_size(req, computed, budget.tokens_left, prefill_scheduled)
            # an interactive prompt's work (a chunk, or its image's encoding) keeps batch out
            claims_step = req.priority is Priority.INTERACTIVE and self.config.limits.time_sized
            encoding_before = len(out.encoder_work)
            queued_behind_peer = req.priority in progressed
            if n and req.prompt.images:
                n = self._gate_on_images(req, computed, n, budget, out, queued_behind_peer)
                n = min(n, max(0, budget.tokens_left))  # encoder work and tokens share it
            if len(out.encoder_work) > encoding_before:
                progressed.add(req.priority)
                interactive_prompt_work |= claims_step
            if n and budget.limit_s is not None:
                n = self._fit_or_defer(req, computed, n, budget, queued_behind_peer)
            if n == 0:
                continue
            if is_waiting:
                if not self.kv.allocate_with_prefix(
                    req.request_id, cached_blocks, computed + n, req.num_tokens
                ):
                    continue  # admissions never preempt; a smaller request may still fit
                self.waiting.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = computed
                req.num_cached_tokens = max(req.num_cached_tokens, computed)
            elif not self._reserve(req, n, scheduled, out):
                continue
            req.deferred_steps = 0
            interactive_prompt_work |= claims_step
            progressed.add(req.priority)
            if req.priority is Priority.BATCH:
                prefill_tokens_batch += n
            budget.add_chunk(computed, n)
            self._emit(req, n, out, now)
            scheduled.add(req.request_id)
            prefill_scheduled = True
            prefill_tokens += n
        if not interactive_active and not prefill_tokens and out.encoder_work:
            self._hold_batch_decodes(out, budget)
        # jobs of encodings that expired or aborted requests left half done: dropped before
        # this step's new jobs start (one may be the same image, encoded afresh)
        out.evicted_encoder_hashes.extend(self.encoder_cache.take_abandoned())
        # interruptible only where there is something to give up: prompt rows (run eager, with
        # safe points in every layer) or encoder work (between items)
        out.interruptible = budget.interruptible and bool(prefill_tokens or out.encoder_work)
        # Encoding gives way to a chat at no cost (the items run are kept; the chunks behind
        # it have not run), so it does in every batch-only step, also within an interruptible
        # step's wait after a chat (_quiet_since_chat), where steps are plain and short: a
        # chat sent between others' requests, four frames in flight, waited out half a 40-50
        # ms encoder step -- TTFT 55 ms against 34 alone (1.63x, 2-core Zen 4 EPYC,
        # benchmarks.interactive_first --ttft-only, 40 requests).
        out.encoding_interruptible = (
            not interactive_active and bool(out.encoder_work) and budget.limits.interrupt_points > 0
        )
        if not prefill_tokens:
            budget.features.force_eager = False  # no prompt rows: decodes run as they always do
        out.features = budget.features
        out.target_s = budget.limit_s
        out.interactive_decodes = interactive_decoding
        out.paced = (
            interactive_decoding
            and restricted
            and budget.limit_s is not None
            and bool(prefill_tokens_batch or out.encoder_work)
        )
        out.chat_decode_s = budget.decode_only_s(chat_contexts)
        if budget.limit_s is not None:
            out.predicted_s = budget.predicted_s
            out.encoder_item_overhead = budget.encoder_item_overhead()
        self.last_target_s = budget.limit_s
        self.last_prefill_budget = (
            prefill_tokens if budget.limit_s is not None else budget.tokens_left + prefill_tokens
        )
        return out

    def _quiet_since_chat(self, budget: StepBudget, now: float) -> bool:
        """Whether interactive work has been out of the engine long enough for an
        interruptible step: at least the time such a step may run.

        Why: an interrupted step's prompt rows are lost (engine/step_interrupt.py). A chat
        client that sends its next request right after the last one ends (an agent loop, a
        user sending several questions) lands in every such step: on a 2-core AVX2 EPYC one
        chat stream of 4-token requests beside a camera frame gave up every interruptible step
        (300-650 tokens of the frame each, ~3 s of compute in every 10 s), and a frame waited
        65 s, in one benchmark run 600 s without a token. Within that time of the last chat
        the batch work runs in plain short steps, which keep their work and hold an arriving
        chat to one step bound as well."""
        bound = budget.interruptible_bound_s()
        return bound is None or now - self.last_interactive_time >= bound

    def _hold_batch_decodes(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """Take camera decodes out of a step that would run the language model for them alone.

        Called for steps with only batch work whose prompt side is image encoding (no prompt
        token, nobody interactive to keep fluid). A decode there costs a whole pass over the
        decoder weights for one token (~6 ms for bench on a 2-core Zen 5 EPYC), where a step
        with prompt rows carries it for a fraction of a millisecond, and it slows the
        encoder work around it (its weights evict the tower's working set: 7.8 against 7.2
        us a unit). Camera frames queued behind each other decoded one at a time beside the
        next frame's encoding, which cost camera-only work ~5 % against a fixed 2,048-token
        budget that encodes several frames in one step and then decodes them together
        (``benchmarks.default_cost``). A held decode rides the next step with prompt rows,
        or runs after ``max_deferred_steps`` held steps (a frame's description is delayed by
        its successors' encoding, never starved). The step's encoder grant was sized with
        the decodes in; it ends that much sooner, which costs encoder-only steps nothing
        (they pay no per-step floor). Steps that preempted work are left alone: the room
        was made for these decodes."""
        if out.preempted_ids:
            return
        held: set[str] = set()
        for chunk in out.chunks:
            if not chunk.is_decode:
                continue
            req = self.requests[chunk.request_id]
            if req.priority is not Priority.BATCH:
                return
            if req.held_decode_steps >= self.config.max_deferred_steps:
                continue
            held.add(chunk.request_id)
        if not held:
            return
        for chunk in out.chunks:
            if chunk.request_id in held:
                budget.remove_decode(chunk.start + 1)
                self.requests[chunk.request_id].held_decode_steps += 1
        out.chunks = [c for c in out.chunks if c.request_id not in held]
        out.held_decodes = len(held)

    def new_budget(self) -> StepBudget:
        """An empty account for one step under this scheduler's limits and cost model."""
        return StepBudget(
            self.config.limits,
            self.cost_model,
            self.config.fused_decode_rows,
            self.kv.block_size,
            self.config.encoder_unit_tokens,
            self.config.fused_prefill_rows,
            self.config.fused_gemv_rows,
            pace=self.pace.ratio,
        )

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step that ran to its end: a paced one (batch work beside chat decodes under the
        ITL target) tells how such steps run against their prediction."""
        if out.paced and out.predicted_s:
            self.pace.observe(seconds, out.predicted_s)

    def _fit_or_defer(
        self, req: Request, start: int, n: int, budget: StepBudget, queued_behind_peer: bool
    ) -> int:
        """The largest chunk the step's time allows; a prefill deferred for
        ``max_deferred_steps`` steps gets a chunk anyway (no starvation): one block's worth,
        or the rows the fused kernel still takes, so the forced step stays a fused one.

        ``queued_behind_peer``: an earlier request of its class got prompt work in this step.
        That is first come, first served, not starvation, and counts no deferral: with six
        camera frames queued beside four chat streams each younger frame forced a block or an
        encoder item every 17th step, out of the older frames' share (past the ITL target by
        up to ``STARVED_STEP_STRETCH``), so frames finished later together rather than one by
        one. (Not measured apart from session 28's other changes.)"""
        k = budget.fit_chunk(start, n, interactive=req.priority is Priority.INTERACTIVE)
        if k == 0:
            if queued_behind_peer:
                return 0
            req.deferred_steps += 1
            if req.deferred_steps > self.config.max_deferred_steps:
                return min(n, budget.starved_chunk(self.kv.block_size, start))
        return k

    # ---- stall-free encoding --------------------------------------------------------------
    def _gate_on_images(
        self,
        req: Request,
        start: int,
        n: int,
        budget: StepBudget,
        out: SchedulerOutput,
        queued_behind_peer: bool = False,
    ) -> int:
        """Advance the encoding of images this chunk reaches; cut the chunk before the first
        image whose embeddings will not be ready by the end of this step.

        Returns the tokens the chunk may cover; encoder work is charged to ``budget``.
        """
        for im in req.prompt.images:
            if im.offset >= start + n:
                break
            if im.offset + im.num_tokens <= start or self.encoder_cache.ready(im.content_hash):
                continue
            h = im.content_hash
            if h not in out.encoder_work:
                self._pin_image(req, im, out)
                text_before = max(0, im.offset - start)  # the chunk's tokens ahead of it
                units = self._encoder_allowance(budget, text_before, req, queued_behind_peer)
                if units > 0:
                    out.encoder_work[h] = units
                    left = self.encoder_cache.encoding_left(h)
                    planned = units if left is None else min(units, left)
                    if math.isfinite(planned):
                        budget.add_encoder(planned)
            left = self.encoder_cache.encoding_left(h)
            units = out.encoder_work.get(h, 0.0)
            completes = math.isinf(units) or (left is not None and units >= left * (1 - 1e-9))
            if not completes:
                return max(0, im.offset - start)
        return n

    def _pin_image(self, req: Request, im, out: SchedulerOutput) -> None:
        if self.encoder_cache.pinned_by(im.content_hash, req.request_id):
            return
        must_encode, evicted = self.encoder_cache.acquire(
            im.content_hash, req.request_id, im.num_tokens
        )
        out.evicted_encoder_hashes.extend(evicted)
        if must_encode:
            out.encoder_jobs.append(EncoderJob(im.content_hash, im.pixel_values, im.grid_thw))

    def _encoder_allowance(
        self, budget: StepBudget, reserved_tokens: int, req: Request, queued_behind_peer: bool
    ) -> float:
        """Encoder work (units) this step may carry: the budget's tokens and time left. 0
        defers it (a starved job still gets one work item now and then; one queued behind an
        earlier request of its class that progressed in this step is not starved)."""
        if not self.config.enable_chunked_encoder:
            return math.inf
        units = budget.encoder_allowance(reserved_tokens, batch=req.priority is Priority.BATCH)
        if units <= 0:
            if queued_behind_peer:
                return 0.0
            req.deferred_steps += 1
            if req.deferred_steps > self.config.max_deferred_steps:
                req.deferred_steps = 0
                return 1e-9  # the runner always runs at least one work item
        return units

    def _cached_prefix(self, req: Request) -> list[int]:
        """Reusable blocks for a request being admitted; at least one token is left to compute
        (its logits give the next token)."""
        if not self.kv.enable_prefix_caching:
            return []
        hashes = req.full_block_hashes(req.num_tokens - 1, self.kv.block_size)
        return self.kv.find_cached_prefix(hashes)

    def _chunk_size(self, req: Request, computed: int, budget: int, prefill_scheduled: bool) -> int:
        remaining = req.num_tokens - computed
        if not self.config.enable_chunked_prefill:
            # whole prompt in one step; an oversized one runs alone rather than never
            if remaining <= budget or not prefill_scheduled:
                return remaining
            return 0
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _reserve(self, req: Request, n: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """KV blocks for ``n`` more tokens of a running request, preempting lower-ranked,
        not-yet-scheduled running requests (newest batch work first) if the pool is short."""
        total = req.num_computed_tokens + n
        while not self.kv.allocate(req.request_id, total):
            victims = [
                r
                for r in self.running
                if r.request_id not in scheduled and r is not req and _rank(r) > _rank(req)
            ]
            if not victims:
                self._preempt(req, out)
                return False
            self._preempt(max(victims, key=_rank), out)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the KV, keep the generated tokens, requeue first."""
        self.running.remove(req)
        self._free(req, keep_encodings=True)  # requeued first: it will want its images
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.waiting.insert(0, req)
        self.num_preemptions += 1
        out.preempted_ids.append(req.request_id)

    def _expire_stale(self, out: SchedulerOutput, now: float) -> None:
        """Work whose deadline passed before its prefill started is dropped uncomputed.

        Any class may carry a deadline: a camera frame past it is stale, and a chat client
        with a deadline (``max_queue_seconds``) prefers a fast refusal to a late answer.
        Started work is never dropped: its KV is already paid for."""
        for req in list(self.waiting):
            if (
                req.deadline is not None
                and req.metrics.first_scheduled_time is None
                and now >= req.deadline
            ):
                self.finish_request(req.request_id, RequestStatus.FINISHED_EXPIRED)
                self.num_expired += 1
                out.expired.append(req)

    def _emit(self, req: Request, n: int, out: SchedulerOutput, now: float) -> None:
        start = req.num_computed_tokens
        end = start + n
        is_decode = n == 1 and not req.is_prefill
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = now
        if not is_decode:
            req.metrics.num_prefill_chunks += 1
        image_slices = []
        for im in req.prompt.images:
            lo, hi = max(start, im.offset), min(end, im.offset + im.num_tokens)
            if lo >= hi:
                continue
            self._pin_image(req, im, out)
            if not self.encoder_cache.ready(im.content_hash):
                out.encoder_work.setdefault(im.content_hash, math.inf)  # must be ready now
            image_slices.append((im.content_hash, lo - im.offset, hi - im.offset, lo - start))
        text_position = req.text_position(start) if n == 1 else None
        out.chunks.append(
            ScheduledChunk(
                request_id=req.request_id,
                start=start,
                num_tokens=n,
                token_ids=req.token_ids(start, end),
                # a decode's positions are built only if an eager forward asks for them
                positions=None if text_position is not None else req.positions(start, end),
                block_table=list(self.kv.block_table(req.request_id)),
                image_slices=image_slices,
                sample=end == req.num_tokens,
                is_decode=is_decode,
                params=req.params,
                generator=req.generator,
                output_token_ids=req.output_token_ids,
                prompt_token_ids=req.prompt_token_ids,
                grammar=req.grammar,
                text_position=text_position,
            )
        )

    # ---- results --------------------------------------------------------------------------
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        encoder_progress: dict[str, float] | None = None,
        interrupted: bool = False,
    ) -> tuple[list[tuple[Request, list[int]]], list[Request]]:
        """Advance computed counts, append sampled tokens, stop finished requests.

        ``interrupted``: the runner gave the step up (engine/step_interrupt.py) before its
        decoder forward finished: only the encoder work it did counts; every chunk runs again
        from the same position (its blocks stay allocated).

        Returns (requests that got a new token, with it) and the requests finished this step.
        """
        now = self.clock()
        if encoder_progress:
            self.encoder_cache.update_progress(encoder_progress)
        progressed: list[tuple[Request, list[int]]] = []
        finished: list[Request] = list(out.expired)
        for chunk in [] if interrupted else out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += chunk.num_tokens
            req.held_decode_steps = 0
            self.kv.name_full_blocks(
                req.request_id,
                req.full_block_hashes(req.num_computed_tokens, self.kv.block_size),
            )
            if req.metrics.prefill_done_time is None and (
                req.num_computed_tokens >= req.num_prompt_tokens
            ):
                req.metrics.prefill_done_time = now
            if not chunk.sample:
                continue
            token = sampled[chunk.request_id]
            req.output_token_ids.append(token)
            if req.grammar is not None:  # the one place a constrained request accepts a token
                req.grammar.accept(token)
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            elif m.last_token_time is not None:
                gap = now - m.last_token_time
                m.itl_max_s = max(m.itl_max_s, gap)
                m.itl_total_s += gap
                m.num_itl += 1
            m.last_token_time = now
            progressed.append((req, [token]))
            status = self._stop_status(req, token)
            if status is not None:
                if status is RequestStatus.FINISHED_STOPPED:
                    req.stop_reason = None if token in req.eos_token_ids else token
                finished.append(self.finish_request(req.request_id, status))
        return progressed, finished

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        n_out = len(req.output_token_ids)
        if req.grammar is not None and req.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete (even with ignore_eos)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
