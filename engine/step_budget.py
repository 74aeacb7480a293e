"""What one step may carry: tokens, and seconds by the cost model's prediction.

A step is sized two ways at once:

* **tokens** — a hard cap (``--max-num-batched-tokens``, or a memory-safe cap when steps are
  sized by time), shared by decodes, prompt chunks and encoder work (in token equivalents);
* **seconds** — a limit on the step's *predicted* duration (:class:`StepCostModel`):
  ``target_itl_s`` on batch work while interactive requests are active (decoding, prefilling
  or waiting), so chat streams keep their inter-token latency beside camera work, and
  ``max_step_s`` always, so an interactive request that arrives while only camera work runs
  waits at most one short step (and a chat's prompt beside other chats' decodes runs in
  steps no longer than that, nor than 3x their decode step).

``StepLimits`` is the policy, resolved once at engine start; :class:`StepBudget` is one step's
account, with a few verbs the scheduler calls in its own order (decodes, then prompt chunks
best class first): :meth:`add_decode`, :meth:`fit_chunk` / :meth:`add_chunk`,
:meth:`encoder_allowance` / :meth:`add_encoder`, and :meth:`restrict_to_itl` before the first
batch prefill while interactive work is active.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.cost_model import StepCostModel, StepFeatures

AUTO = "auto"
# a prompt the time limit starved for ``max_deferred_steps`` steps may stretch the step it is
# forced into this far past the limit, one token at least: one block at a time beside four chat
# streams (a 42 ms step against a 23 ms target on a 2-core AMX Xeon, every 17th step while six
# frames waited) set the chat ITL p99 on its own
STARVED_STEP_STRETCH = 1.25


class BesideChatPace:
    """How steps carrying batch work beside chat decodes ran against their prediction: the
    ratio (measured / predicted seconds) the ITL target's batch room is scaled by.

    Why: the cost model prices each part of a step by its own clock, and beside chat the
    parts overlap in ways a linear model cannot see. On a 2-core AVX2 EPYC, four chat streams
    beside camera frames, when encoder pieces ran on one thread (before engine/openmp.py) while
    the front end streamed the chat tokens on the other, the decode forward after one ran ~3
    ms faster than in a step without one (12.1 against 15.9 ms). Steps sized to an 18.4 ms
    target ran 16.4 ms: ~2 ms of every step the camera could have had went unused, and the
    chat ITL stood at 1.04x alone against the 1.25x it may take. Where steps run longer than
    predicted (a busy front end), the same ratio above 1 shrinks the room for the chat's ITL
    (measured on that AVX2 machine only, where the ratio stayed 0.9-1.05). An exponential
    average over the last ~20 such steps, clipped to ``[low, high]``: a correction of the
    model's residual, never a second model."""

    def __init__(self, alpha: float = 0.05, low: float = 0.8, high: float = 1.25) -> None:
        self.alpha, self.low, self.high = alpha, low, high
        self.ratio = 1.0

    def observe(self, measured_s: float, predicted_s: float) -> None:
        if predicted_s <= 0 or not math.isfinite(measured_s):
            return
        sample = min(self.high, max(self.low, measured_s / predicted_s))
        self.ratio += self.alpha * (sample - self.ratio)


@dataclass(frozen=True)
class StepLimits:
    """How steps are sized (resolved from EngineArgs, see ``EngineArgs.step_limits``).

    ``target_itl_s`` / ``max_step_s``: seconds, ``"auto"`` (priced from the predicted eager
    decode step of the moment) or None (no such limit).
    """

    max_tokens: int
    target_itl_s: float | str | None = None
    max_step_s: float | str | None = None
    auto_itl_factor: float = 1.25
    auto_step_factor: float = 4.0
    # a chat prompt beside chat decodes: at most this x their decode step (DESIGN.md calls an
    # ITL over 5x the decode step a stall; the step bound's 50 ms floor alone could exceed it)
    chat_prompt_factor: float = 3.0
    # floor of an "auto" step bound: below it per-step overhead dominates even on a GPU
    min_auto_step_s: float = 0.05
    # an "auto" step bound's encoder work in a step without prompt tokens: at most this x the
    # decode step (floor: min_encoder_step_s), see StepBudget.encoder_allowance
    encoder_only_factor: float = 2.0
    min_encoder_step_s: float = 0.01
    # safe points where a step with no interactive work in the engine can stop for a chat
    # request that arrives (three in each decoder layer, engine/step_interrupt.py); such a step
    # may run this many step bounds, so the longest stretch between two safe points takes
    # about one (LLMEngine._interrupt_points). 0: no step is interruptible
    interrupt_points: int = 0

    @property
    def time_sized(self) -> bool:
        return self.target_itl_s is not None or self.max_step_s is not None


class StepBudget:
    """One step's account of tokens and predicted seconds."""

    def __init__(
        self,
        limits: StepLimits,
        cost_model: StepCostModel,
        fused_decode_rows: int = 0,
        block_size: int = 16,
        encoder_unit_tokens: float = 0.01,
        fused_prefill_rows: int = 0,
        gemv_rows: int = 0,
        pace: float = 1.0,
    ) -> None:
        self.limits = limits
        self.pace = pace  # BesideChatPace.ratio: measured / predicted, beside chat
        self.cost_model = cost_model
        self.block_size = block_size
        self.encoder_unit_tokens = encoder_unit_tokens
        self.tokens_left = limits.max_tokens
        self.features = StepFeatures(
            fused_decode_rows=fused_decode_rows,
            fused_prefill_rows=fused_prefill_rows,
            gemv_rows=gemv_rows,
        )
        self.limit_s: float | None = None  # set by open_prefill
        self.itl_target_s: float | None = None
        self.interruptible = False  # set by open_prefill
        self.beside_interactive = False  # batch work under the ITL target (restrict_to_itl)

    # ---- decodes ------------------------------------------------------------------------------
    def add_decode(self, context_len: int) -> bool:
        """One decode token at ``context_len`` (its position + 1); False when out of tokens."""
        if self.tokens_left < 1:
            return False
        self.tokens_left -= 1
        self.features.add_decode(context_len)
        return True

    def remove_decode(self, context_len: int) -> None:
        """Take back a decode :meth:`add_decode` counted (a batch decode held out of an
        encoder-only step, see ``Scheduler._hold_batch_decodes``)."""
        self.tokens_left += 1
        self.features.remove_decode(context_len)

    # ---- the time limit -----------------------------------------------------------------------
    def open_prefill(
        self,
        interactive_decoding: bool,
        interactive_prompts: bool = False,
        interruptible: bool = False,
    ) -> None:
        """Fix the time limit for prompt work once the decodes are in: the step bound (batch
        work gets the ITL target on top, :meth:`restrict_to_itl`). Limits need a fitted cost
        model.

        ``interruptible``: no interactive request is in the engine at all. With
        ``interrupt_points`` the step may then run that many step bounds
        (:meth:`interruptible_bound_s`) and is priced as the eager forward it will run (the
        one with safe points in every layer, engine/step_interrupt.py): a chat that arrives
        meanwhile waits about half a layer, under one step bound as with short steps, and camera
        prompts pay the per-step weight read once per several hundred tokens, not per ~100.

        Interactive prompts with no interactive stream decoding (``interactive_prompts`` and
        not ``interactive_decoding``) get no time limit, only the token cap: there is nobody
        to stall, and a chat that arrives meanwhile waits behind these prompts whatever the
        step size (first come, first served within a class), so the bound would buy nothing
        and cost throughput. Eight chats sent at once prefilled two prompts a step and the
        other six in small chunks beside their decodes: 13.5 % below a fixed 2,048-token
        budget on a 2-core Zen 5 EPYC (``benchmarks.default_cost``). Camera work does not
        join a step with an interactive prompt in it at all (``Scheduler.schedule``).

        Why not the ITL target for interactive prompts too: it protects chat streams from
        camera work, and applied between chat requests it starved the waiting ones. Eight
        chats sent at once got ~5 prompt tokens a step beside the first one's decodes: 30 %
        less throughput than a fixed 2,048-token budget on a 2-core AVX2 EPYC
        (``benchmarks.default_cost``), every TTFT but the first seconds long. Under the step
        bound a waiting chat's prompt takes the fused kernel's spare rows (or a bigger chunk,
        where that costs less per token): the running streams' ITL stretches for a step or
        two, never past the bound nor past ``chat_prompt_factor`` x their decode step (under
        the stall line whatever the bound's floor). Without a step bound (``--max-step-ms
        off``) interactive prompts keep the ITL target, as no other limit would hold them."""
        if not self.cost_model.ready:
            return
        self.itl_target_s = self._resolve(
            self.limits.target_itl_s, self.limits.auto_itl_factor, floor=0.0
        )
        bound = self.step_bound_s()
        if interruptible and bound is not None and self.limits.interrupt_points > 0:
            self.interruptible = True
            self.limit_s = self.interruptible_bound_s()
            self.features.force_eager = True
        elif bound is None:
            self.limit_s = self.itl_target_s if interactive_decoding else None
        elif not interactive_decoding and interactive_prompts:
            self.limit_s = None
        elif interactive_decoding:
            self.limit_s = min(bound, self._resolve(AUTO, self.limits.chat_prompt_factor, 0.0))
        else:
            self.limit_s = bound

    def step_bound_s(self) -> float | None:
        """The bound on any step's predicted time, "auto" resolved against this step."""
        return self._resolve(
            self.limits.max_step_s, self.limits.auto_step_factor, self.limits.min_auto_step_s
        )

    def interruptible_bound_s(self) -> float | None:
        """The bound on an interruptible step's predicted time: ``interrupt_points`` step
        bounds (None: no step bound, or no safe points)."""
        bound = self.step_bound_s()
        if bound is None or self.limits.interrupt_points <= 0:
            return None
        return bound * self.limits.interrupt_points

    def restrict_to_itl(self) -> None:
        """Batch work in a step while interactive work is active gets the ITL target at most:
        the interactive request's next token is in this step or the next. The target is in
        measured seconds, the budget counts predicted ones: divided by the pace
        (:class:`BesideChatPace`), it is what such steps have been predicted at when they
        ran the target."""
        self.beside_interactive = True
        if self.itl_target_s is not None:
            target = self.itl_target_s / self.pace
            self.limit_s = target if self.limit_s is None else min(self.limit_s, target)

    def _resolve(self, value: float | str | None, factor: float, floor: float) -> float | None:
        if value is None:
            return None
        if value != AUTO:
            return float(value)
        # priced as the decodes would run with a prompt token beside them: in the fused kernel
        # while it still has a row to spare (prompt work then costs only its rows), else as an
        # eager forward, which a limit priced on the fused decode-only step would never admit
        f = self.features
        decodes = f if f.decode_tokens else dataclasses.replace(f, decode_tokens=1)
        mixed_fused = decodes.decode_tokens < f.fused_prefill_rows
        priced = dataclasses.replace(decodes, force_eager=not mixed_fused)
        return max(floor, factor * self.cost_model.predict(priced))

    def decode_only_s(self, context_lens: list[int]) -> float | None:
        """Predicted seconds of a step running only decodes at these context lengths, as this
        engine would run it (fused kernel or eager); None without decodes or a fitted model."""
        if not context_lens or not self.cost_model.ready:
            return None
        f = self.features
        return self.cost_model.predict(
            StepFeatures(
                decode_tokens=len(context_lens),
                attention_units=float(sum(context_lens)),
                decode_attention_units=float(sum(context_lens)),
                fused_decode_rows=f.fused_decode_rows,
                fused_prefill_rows=f.fused_prefill_rows,
                gemv_rows=f.gemv_rows,
            )
        )

    @property
    def predicted_s(self) -> float:
        return self.cost_model.predict(self.features)

    def time_left(self) -> float:
        if self.limit_s is None:
            return math.inf
        return max(0.0, self.limit_s - self.predicted_s)

    # ---- prompt chunks ------------------------------------------------------------------------
    def fit_chunk(self, start: int, n: int, interactive: bool = False) -> int:
        """Largest chunk (<= n) of a prompt at ``start`` that fits the tokens and the time
        left; 0 when none does (the scheduler decides whether a starved request goes anyway).
        A camera prompt's chunk beside interactive work may be cut back to the kernel's GEMV
        for a better rate (:meth:`_better_fused`); an ``interactive`` prompt's is not: its
        user waits for the whole prompt."""
        n = min(n, max(0, self.tokens_left))
        if n == 0 or self.limit_s is None:
            return n
        if self.cost_model.compute_bound_prefill_s() <= 0:
            # the fit has not separated prefill cost yet: a prediction would call any chunk free
            return min(n, self.block_size)

        def cost(k: int) -> float:
            return self.cost_model.predict(self.features.plus(_chunk(start, k)))

        return self._better_fused(_largest_within(cost, n, self.limit_s), cost, interactive)

    def starved_chunk(self, block_size: int, start: int = 0) -> int:
        """Tokens a prefill (at ``start``) starved by the time limit gets anyway: one block,
        or fewer when more would push the step out of the fused kernel (whose eager floor
        would stall every chat stream in it: 160-340 ms against a 25 ms step on a 2-core AVX2
        EPYC) or out of the kernel's own GEMV (oneDNN's floor past it: 4 chat decodes and a
        forced 16-token block ran 51 ms against a 33 ms target on a 2-core AMX Xeon, 12 rows
        would have run ~23) or the step past ``STARVED_STEP_STRETCH`` times its time limit
        (one token at least: the guard is for liveness; throughput is what the limit grants).

        0 when other prompt chunks of this step already took the spare rows: they progress,
        so this request's turn comes (several starved frames each forcing one token used to
        push a step to 18 rows and into the eager path). When the decodes alone fill the
        kernel (or its GEMV) no chunk can stay in it, so the forced step carries a block."""
        f = self.features
        if not f.fused_decode_rows or f.fused_prefill_rows <= 0:
            return self._within_stretch(start, block_size)
        if f.decode_tokens < f.gemv_rows:
            spare = f.gemv_rows - f.prefill_tokens - f.decode_tokens
            if spare > 0:
                return self._within_stretch(start, min(block_size, spare))
            return 0
        spare = f.fused_prefill_rows - f.prefill_tokens - f.decode_tokens
        if spare > 0:
            return self._within_stretch(start, min(block_size, spare))
        return 0 if f.prefill_tokens else block_size

    def _within_stretch(self, start: int, n: int) -> int:
        """The most of ``n`` tokens (one at least) whose step stays within the stretched
        limit; all ``n`` without a limit or a fitted prefill price."""
        if self.limit_s is None or self.cost_model.compute_bound_prefill_s() <= 0 or n <= 1:
            return n

        def cost(k: int) -> float:
            return self.cost_model.predict(self.features.plus(_chunk(start, k)))

        return max(1, _largest_within(cost, n, STARVED_STEP_STRETCH * self.limit_s))

    def _better_fused(self, k: int, cost: Callable[[int], float], interactive: bool) -> int:
        """A chunk that would push the step past a cheaper regime of the fused kernel is cut
        back to the rows that regime still takes when that is more prompt tokens per predicted
        second. Past the kernel's own GEMV (``gemv_rows``) a step pays oneDNN's small-row GEMM
        floor, past the kernel (``fused_prefill_rows``) the eager path's: a few more tokens
        rarely repay either.

        The GEMV cut is for batch chunks beside interactive work only: there the step's base
        (the chat decodes) is paid whatever the chunk, so tokens per marginal second is the
        camera's whole cost. A batch-only step pays its base for the camera, and a cut into
        more steps pays it again each time."""
        f = self.features
        if not f.fused_decode_rows or f.force_eager:
            return k
        rows = f.prefill_tokens + f.decode_tokens
        base = self.predicted_s

        def rate(n: int) -> float:
            gain = cost(n) - base
            return math.inf if gain <= 0 else n / gain

        limits = [f.fused_prefill_rows]
        if self.beside_interactive and not interactive:
            limits.append(f.gemv_rows)
        cuts = [limit - rows for limit in limits]
        candidates = [k] + [n for n in cuts if 0 < n < k]
        return max(candidates, key=lambda n: (rate(n), -n))

    def add_chunk(self, start: int, n: int) -> None:
        self.tokens_left -= n
        self.features = self.features.plus(_chunk(start, n))

    # ---- encoder work -------------------------------------------------------------------------
    def tokens_per_encoder_unit(self) -> float:
        """Budget tokens one encoder unit costs: by measured time once the cost model knows
        both rates (vision attention is slower per FLOP than decoder matmuls), by FLOPs before."""
        per_unit = self.cost_model.seconds_per("encoder_units")
        per_token = self.cost_model.compute_bound_prefill_s()
        if per_unit > 0 and per_token > 0:
            return per_unit / per_token
        return self.encoder_unit_tokens

    def encoder_allowance(self, reserved_tokens: int = 0, batch: bool = True) -> float:
        """Encoder units this step may still carry, ``reserved_tokens`` of text kept aside.
        Under a time limit the item the work runs in is paid for first (its fixed cost).
        ``batch`` work in a step without prompt tokens also stops at
        :meth:`encoder_step_bound_s` (a chat's own image is what its user waits for)."""
        units = max(0, self.tokens_left - reserved_tokens) / self.tokens_per_encoder_unit()
        if self.limit_s is None:
            return units
        per_unit = self._seconds_per_encoder_unit()
        if per_unit <= 0:
            return 0.0
        per_item = self.cost_model.seconds_per("encoder_items")
        time_left = self.time_left() - per_item
        if batch and not self.features.prefill_tokens and not self.interruptible:
            # text before the image may follow; an interruptible step stops between items
            # room for an item and as much again of work at least: a per-item price above
            # the short bound would otherwise leave every such step empty (starved)
            left = max(self.encoder_step_bound_s() - self.predicted_s, 2 * per_item)
            time_left = min(time_left, left - per_item)
        return min(units, max(0.0, time_left) / per_unit)

    def encoder_step_bound_s(self) -> float:
        """The bound on a step whose work is encoding alone (no prompt tokens) under an
        "auto" step bound: ``encoder_only_factor`` x the decode step (inf: no such bound).

        Why shorter than the step bound: such steps (camera frames encoding, no chat) are
        what an arriving chat request waits behind most of the time, and they pay no
        per-step floor (no decoder forward, or only camera decodes'), so cutting them finer
        costs the camera little. On a 2-core AMX Xeon, while 4 frames were in flight, 35-48
        ms encoder-only steps made up most of the time; a chat's TTFT there was 57 ms against
        29 alone (1.94x; ``benchmarks.interactive_first``). Prompt chunks keep the full
        bound: each step re-reads the decoder's weights."""
        if self.limits.max_step_s != AUTO:
            return math.inf
        return self._resolve(AUTO, self.limits.encoder_only_factor, self.limits.min_encoder_step_s)

    def encoder_item_overhead(self) -> float:
        """The fixed cost of one vision work item in encoder units: what the runner charges
        each item it runs (``VisionEncodeJob.advance``), 0 until the cost model has a price."""
        per_unit = self._seconds_per_encoder_unit()
        per_item = self.cost_model.seconds_per("encoder_items")
        return per_item / per_unit if per_unit > 0 and per_item > 0 else 0.0

    def _seconds_per_encoder_unit(self) -> float:
        per_unit = self.cost_model.seconds_per("encoder_units")
        if per_unit <= 0:  # not separated by the fit yet: price it by FLOPs, never as free
            per_unit = self.cost_model.compute_bound_prefill_s() * self.encoder_unit_tokens
        return per_unit

    def add_encoder(self, units: float) -> None:
        """Account for encoder work that will run (finite units only), in one work item."""
        self.features.encoder_units += units
        self.features.encoder_items += 1
        self.tokens_left -= math.ceil(units * self.tokens_per_encoder_unit())


def _largest_within(cost: Callable[[int], float], n: int, bound: float) -> int:
    """Largest k <= n with cost(k) <= bound (0 when none): a binary search, the cost of a
    chunk growing with its tokens."""
    if cost(n) <= bound:
        return n
    lo, hi = 0, n  # cost(lo) fits (lo = 0: nothing), cost(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= bound:
            lo = mid
        else:
            hi = mid
    return lo


def _chunk(start: int, n: int) -> StepFeatures:
    features = StepFeatures()
    features.add_chunk(start, n)
    return features
