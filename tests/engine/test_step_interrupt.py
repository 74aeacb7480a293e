"""Interruptible batch-only steps: long when no chat is in the engine, given up for one.

Step sizes come from a synthetic cost model (the scheduler's view of time); the real tiny
model runs every step, so a step given up and run again must leave every token as it was.
Interruptions are injected at chosen safe points (a step on the tiny model is too short to
hit one by timing); the async engine test raises the flag the way the server does, from
another thread while a step runs.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import LLM, AsyncEngine, EngineArgs, SamplingParams
from engine.cost_model import StepCostModel
from engine.kernels import load_cpu_decode
from engine.llm_engine import LLMEngine
from engine.step_interrupt import StepInterrupt, StepInterrupted
from tests.engine.helpers import SYNTHETIC_COSTS, image_conv, noise_image, text_conv

FEW = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
BOUND_MS = 30


def _engine(checkpoint, **kw) -> LLMEngine:
    kw = {"dtype": "float32", "enable_prefix_caching": False, **kw}
    eng = LLMEngine(EngineArgs(model=str(checkpoint), max_step_ms=str(BOUND_MS), **kw))
    eng.scheduler.cost_model = StepCostModel(coefficients=SYNTHETIC_COSTS)
    return eng


def _frame(seed: int):
    return image_conv("Describe everyone in view.", noise_image(224, 168, seed=seed))


def _reference(checkpoint, conv) -> list[int]:
    llm = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=4096)
    return llm.chat(conv, FEW)[0].outputs[0].token_ids


def _finish(eng: LLMEngine) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs


class _RaiseAtCheck(StepInterrupt):
    """Fault injection: the ``n``-th safe point of the eager forward finds a chat queued
    (``requested`` stays False, so the vision items before it all run)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.calls = n, 0

    def check(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise StepInterrupted


def _points(eng: LLMEngine) -> int:
    return eng.scheduler.config.limits.interrupt_points


def test_each_stretch_between_safe_points_fits_one_bound(tiny_qwen2_vl):
    """An interruptible step runs ``interrupt_points`` bounds; a layer then takes points /
    layers of them, and its longest part (attention, gate/up, down) at most one: a chat
    waits one short step. Qwen2-style layers (MLP 3 x hidden x intermediate) give more than
    one bound per layer."""
    eng = _engine(tiny_qwen2_vl)
    layers = eng.model.layers
    per_layer = _points(eng) / len(layers)
    assert per_layer > 1
    for layer in layers:
        assert layer.longest_part_share * per_layer <= 1 + 1e-9


def test_bench_shaped_layers_split_in_half_by_weight():
    """The bench preset (hidden 768, 12 heads of 64, 4 KV heads, intermediate 2,048): the
    gate/up product is half a layer's weights, so a layer may take two bounds."""
    from types import SimpleNamespace

    from engine.models.qwen2_vl import DecoderLayer

    cfg = SimpleNamespace(
        hidden_size=768,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        rms_norm_eps=1e-6,
    )
    assert DecoderLayer(cfg, head_dim=64).longest_part_share == pytest.approx(0.5)


def test_batch_only_steps_run_many_bounds_and_chat_makes_them_short(tiny_qwen2_vl):
    eng = _engine(tiny_qwen2_vl)
    points = _points(eng)
    eng.add_request("report", text_conv("words " * 200), FEW, priority="batch")
    eng.add_request("cam", _frame(7), FEW, priority="batch")
    sched = eng.scheduler.schedule()
    assert sched.interruptible
    assert sched.target_s == pytest.approx(points * BOUND_MS / 1e3)
    assert eng.scheduler.cost_model.predict(sched.features) <= sched.target_s + 1e-9
    assert sched.num_prefill_tokens > 50, "far more than one short step's ~50 tokens"
    assert sched.features.force_eager, "priced as the eager forward it runs"
    result = eng.runner.execute(sched)
    assert not result.interrupted
    eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)

    eng.add_request("chat", text_conv("hi there"), FEW, priority="interactive")
    while eng.scheduler.requests.get("chat") is not None:
        sched = eng.scheduler.schedule()
        assert not sched.interruptible, "a chat in the engine: every step short"
        assert sched.target_s is None or sched.target_s <= BOUND_MS / 1e3 + 1e-9
        result = eng.runner.execute(sched)
        eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)


@pytest.mark.skipif(load_cpu_decode() is None, reason="needs the fused CPU kernel")
def test_interruptible_prompt_steps_skip_the_fused_kernel_and_decodes_keep_it(tiny_qwen2_vl):
    """The fused kernel runs every layer in one native call (no safe point): an interruptible
    step's prompt rows go eager even where the kernel takes them, and are priced so; a
    decode-only step keeps the kernel and its price."""
    eng = _engine(tiny_qwen2_vl, dtype="bfloat16", device="cpu")
    runner = eng.runner
    assert runner.fused_prefill_rows > 0 and runner.fused_decode_rows > 0
    # a raw prompt of a few tokens: a chat template's ~45 would pass AVX2's 16-row kernel
    eng.add_request("report", "words " * 4, FEW, priority="batch")
    sched = eng.scheduler.schedule()
    assert sched.interruptible and 0 < sched.num_prefill_tokens <= runner.fused_prefill_rows
    assert sched.features.eager_forward
    fused_before = runner.fused_prefill_steps
    eng.step_interrupt.clear()
    result = runner.execute(sched)
    eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)
    assert runner.fused_prefill_steps == fused_before, "prompt rows ran eager"
    sched = eng.scheduler.schedule()
    assert sched.num_decode_tokens == 1 and not sched.num_prefill_tokens
    assert not sched.interruptible and not sched.features.eager_forward


def test_steps_stay_short_for_one_long_step_after_a_chat(tiny_qwen2_vl):
    """A chat client that sends its next request as soon as the last one ends would land in
    every interruptible step and throw its prompt rows away (a frame beside one chat stream
    of short requests waited 65-600 s). For as long as an interruptible step may run after
    interactive work leaves the engine, batch-only steps are plain short ones; then long."""
    eng = _engine(tiny_qwen2_vl)
    clock = [100.0]
    eng.scheduler.clock = lambda: clock[0]
    eng.add_request("chat", text_conv("hi there"), FEW, priority="interactive")
    _finish(eng)
    eng.add_request("cam", _frame(7), FEW, priority="batch")
    long_s = _points(eng) * BOUND_MS / 1e3
    clock[0] += long_s / 2
    sched = eng.scheduler.schedule()
    assert not sched.interruptible and sched.target_s == pytest.approx(BOUND_MS / 1e3)
    assert sched.num_prefill_tokens or sched.encoder_work, "the frame moves meanwhile"
    result = eng.runner.execute(sched)
    eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)
    clock[0] += long_s / 2
    sched = eng.scheduler.schedule()
    assert sched.interruptible and sched.target_s == pytest.approx(long_s)


def test_off_keeps_every_step_under_the_bound(tiny_qwen2_vl):
    eng = _engine(tiny_qwen2_vl, interruptible_steps=False)
    assert eng.scheduler.config.limits.interrupt_points == 0
    eng.add_request("cam", _frame(7), FEW, priority="batch")
    sched = eng.scheduler.schedule()
    assert not sched.interruptible and sched.target_s == pytest.approx(BOUND_MS / 1e3)
    # nor does a fixed token budget size steps by time at all
    fixed = LLMEngine(EngineArgs(model=str(tiny_qwen2_vl), max_num_batched_tokens=64))
    assert fixed.scheduler.config.limits.interrupt_points == 0


def test_a_step_given_up_before_it_starts_changes_nothing(tiny_qwen2_vl):
    expected = _reference(tiny_qwen2_vl, _frame(3))
    eng = _engine(tiny_qwen2_vl)
    eng.add_request("cam", _frame(3), FEW, priority="batch")
    eng.step_interrupt.request()
    assert eng.step() == []
    req = eng.scheduler.requests["cam"]
    assert req.num_computed_tokens == 0 and not req.output_token_ids
    assert eng.get_stats().num_interrupted_steps == 1
    assert eng.stats.total_prefill_tokens_computed == 0
    image = req.prompt.images[0].content_hash
    assert not eng.encoder_cache.ready(image), "no vision item ran"
    eng.step_interrupt.clear()
    assert _finish(eng) == {"cam": expected}


class _CountChecks(StepInterrupt):
    """Counts the eager forward's safe points; never gives the step up."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def check(self) -> None:
        self.calls += 1


def test_safe_points_come_after_each_layers_attention_its_gate_up_and_between_layers(
    tiny_qwen2_vl,
):
    """A chat waits for a third of a layer, not a whole one: 3 x layers - 1 safe points."""
    eng = _engine(tiny_qwen2_vl)
    counter = _CountChecks()
    eng.runner.interrupt = counter
    eng.add_request("report", text_conv("words " * 40), FEW, priority="batch")
    sched = eng.scheduler.schedule()
    assert sched.interruptible and sched.num_prefill_tokens > 0
    result = eng.runner.execute(sched)
    assert not result.interrupted
    assert counter.calls == 3 * len(eng.model.layers) - 1


# check 1 is after layer 0's attention, check 2 between its MLP's products, check 3 after it
@pytest.mark.parametrize("at_check", [1, 2, 3])
def test_a_forward_given_up_at_a_safe_point_is_run_again_exactly(tiny_qwen2_vl, at_check):
    """The layers already run wrote KV rows for the chunk; the rerun writes them again, so
    the tokens are those of a step never interrupted (text and image prompts, decodes)."""
    convs = {"cam": _frame(5), "report": text_conv("words " * 120)}
    eng = _engine(tiny_qwen2_vl)
    for rid, conv in convs.items():
        eng.add_request(rid, conv, FEW, priority="batch")
    real, injected = eng.runner.interrupt, _RaiseAtCheck(at_check)
    eng.runner.interrupt = injected
    for _ in range(4):  # the first step may be the frame's encoding alone
        computed = {rid: eng.scheduler.requests[rid].num_computed_tokens for rid in convs}
        eng.step()  # its prompt rows run eager
        if injected.calls >= at_check:
            break
    assert injected.calls == at_check and eng.get_stats().num_interrupted_steps == 1
    assert computed == {rid: eng.scheduler.requests[rid].num_computed_tokens for rid in convs}
    eng.runner.interrupt = real
    outputs = _finish(eng)
    for rid, conv in convs.items():
        assert outputs[rid] == _reference(tiny_qwen2_vl, conv), rid


def _step_giving_way_after_two_items(eng: LLMEngine) -> list:
    """One step of the frame ``cam`` in which the flag rises after the second vision item:
    those two stay done and nothing else ran. Returns what the runner was handed."""
    ran, steps = [], []
    real_requested, real_execute = eng.step_interrupt.requested, eng.runner.execute

    def after_two_items() -> bool:
        ran.append(1)
        return len(ran) > 2 or real_requested()

    def execute(sched):
        steps.append(sched)
        return real_execute(sched)

    eng.step_interrupt.requested, eng.runner.execute = after_two_items, execute
    assert eng.step() == []
    eng.step_interrupt.requested, eng.runner.execute = real_requested, real_execute
    assert eng.get_stats().num_interrupted_steps == 1
    image = eng.scheduler.requests["cam"].prompt.images[0].content_hash
    job = eng.runner.encode_jobs[image]
    assert job.items_run == 2 and not job.done()
    assert eng.scheduler.requests["cam"].num_computed_tokens == 0
    return steps


def test_vision_items_run_before_the_interrupt_are_kept(tiny_qwen2_vl):
    """The flag rises after the second vision item: those two stay done, the rest wait."""
    expected = _reference(tiny_qwen2_vl, _frame(9))
    eng = _engine(tiny_qwen2_vl, encoder_rows_per_item=16)
    eng.add_request("cam", _frame(9), FEW, priority="batch")
    assert _step_giving_way_after_two_items(eng)[0].interruptible
    assert _finish(eng) == {"cam": expected}


def test_encoding_gives_way_in_the_short_steps_after_a_chat_too(tiny_qwen2_vl):
    """In the wait after a chat the steps are plain short ones, whose prompt rows no chat
    interrupts (they would be thrown away); their image encoding still stops between items
    for a queued chat, since the items run are kept and nothing behind them has run: a chat
    sent between others' requests no longer waits out half a 40-50 ms encoder step. The
    frame's tokens end as they would uninterrupted. With the chat still in the engine, or
    interruptible steps off, encoding runs whole."""
    expected = _reference(tiny_qwen2_vl, _frame(9))
    eng = _engine(tiny_qwen2_vl, encoder_rows_per_item=16)
    clock = [100.0]
    eng.scheduler.clock = lambda: clock[0]
    eng.add_request("chat", text_conv("hi there"), FEW, priority="interactive")
    _finish(eng)
    eng.add_request("cam", _frame(9), FEW, priority="batch")
    step = _step_giving_way_after_two_items(eng)[0]
    assert not step.interruptible and step.encoding_interruptible
    assert step.target_s == pytest.approx(BOUND_MS / 1e3), "a plain short step"
    assert _finish(eng) == {"cam": expected}

    busy = _engine(tiny_qwen2_vl)
    long_chat = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    busy.add_request("chat", text_conv("hi there"), long_chat, priority="interactive")
    busy.step()  # its prompt: the chat decodes from here on
    busy.add_request("cam", _frame(9), FEW, priority="batch")
    sched = busy.scheduler.schedule()
    assert sched.encoder_work and sched.num_decode_tokens == 1
    assert not sched.encoding_interruptible
    off = _engine(tiny_qwen2_vl, interruptible_steps=False)
    off.add_request("cam", _frame(9), FEW, priority="batch")
    sched = off.scheduler.schedule()
    assert sched.encoder_work and not sched.encoding_interruptible


async def test_a_chat_queued_mid_step_ends_a_camera_step_and_goes_next(tiny_qwen2_vl):
    """The server's path: the front end queues a chat on its own thread while the step thread
    runs a camera step; the step gives way at its next safe point and the chat is in the
    next one. The camera step is held at its start until the flag rises (on the tiny model
    a real step is over before a request could arrive)."""
    engine = AsyncEngine(
        EngineArgs(model=str(tiny_qwen2_vl), dtype="float32", enable_prefix_caching=False)
    )
    try:
        inner = engine.engine
        inner.scheduler.cost_model = StepCostModel(coefficients=SYNTHETIC_COSTS)
        camera_step_started, real_execute = threading.Event(), inner.runner.execute
        held = []

        def execute(sched):
            if sched.interruptible and not held:
                held.append(sched)
                camera_step_started.set()
                assert inner.step_interrupt._flag.wait(timeout=30), "the chat never raised it"
            return real_execute(sched)

        inner.runner.execute = execute
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        camera = asyncio.create_task(_collect(engine, "cam", _frame(2), params, "batch"))
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, camera_step_started.wait, 30)
        chat = await _collect(engine, "chat", text_conv("hello there"), params, "interactive")
        cam = await camera
        assert inner.get_stats().num_interrupted_steps >= 1
        assert held[0].interruptible
        offline = LLM(str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=4096)
        assert chat == offline.chat(text_conv("hello there"), params)[0].outputs[0].token_ids
        assert cam == offline.chat(_frame(2), params)[0].outputs[0].token_ids
    finally:
        engine.shutdown()


async def _collect(engine, rid, conv, params, priority) -> list[int]:
    stream = await engine.add_request(rid, conv, params, priority=priority)
    last = None
    async for out in stream:
        last = out
    return last.outputs[0].token_ids
