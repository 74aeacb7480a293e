"""Steps sized by predicted time by default: the step bound, interactive first, the ITL target.

Timing is driven by a synthetic cost model (the scheduler's view of time); the real tiny model
runs the steps, so outputs stay exact.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from engine import LLM, EngineArgs, SamplingParams
from engine.config import TIME_SIZED_TOKEN_CAP
from engine.cost_model import StepCostModel, StepFeatures
from engine.llm_engine import LLMEngine
from engine.step_budget import (
    AUTO,
    STARVED_STEP_STRETCH,
    BesideChatPace,
    StepBudget,
    StepLimits,
)
from tests.engine.helpers import SYNTHETIC_COSTS, image_conv, noise_image, text_conv

SYNTHETIC = SYNTHETIC_COSTS
FEW = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _served(checkpoint, dtype: str = "float32", **kw) -> LLMEngine:
    """An engine with the server's defaults (``vision-serve serve`` builds it from
    EngineArgs): steps sized by time. The offline ``LLM`` sizes them by tokens alone."""
    return LLMEngine(EngineArgs(model=str(checkpoint), dtype=dtype, **kw))


def _engine(checkpoint, **kw):
    eng = _served(checkpoint, **kw)
    eng.scheduler.cost_model = StepCostModel(coefficients=SYNTHETIC)
    return None, eng


def _run(eng, sched):
    result = eng.runner.execute(sched)
    eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)


def _frame(seed: int):
    return image_conv("Describe everyone in view.", noise_image(224, 168, seed=seed))


def test_defaults_size_steps_by_time_and_a_fixed_budget_keeps_the_token_budget():
    limits = EngineArgs(model="m").step_limits()
    assert (limits.target_itl_s, limits.max_step_s) == (AUTO, AUTO)
    assert limits.max_tokens == TIME_SIZED_TOKEN_CAP and limits.time_sized

    fixed = EngineArgs(model="m", max_num_batched_tokens=512).step_limits()
    assert (fixed.max_tokens, fixed.target_itl_s, fixed.max_step_s) == (512, None, None)
    assert not fixed.time_sized
    asked = EngineArgs(model="m", max_num_batched_tokens=512, target_itl_ms="40").step_limits()
    assert asked.target_itl_s == pytest.approx(0.040) and asked.max_step_s is None

    only_itl = EngineArgs(model="m", max_step_ms="off").step_limits()
    assert only_itl.max_step_s is None and only_itl.target_itl_s == AUTO
    assert EngineArgs(model="m", max_step_ms="250").step_limits().max_step_s == 0.25
    for bad in ("0", "-5", "soon", "inf"):
        with pytest.raises(ValueError, match="max_step_ms"):
            EngineArgs(model="m", max_step_ms=bad)


def test_the_offline_llm_sizes_steps_by_tokens_alone(tiny_qwen2_vl):
    """Offline there is no stream to keep fluid and no request that can arrive mid-call: the
    prompts of one generate() share the first step, uncalibrated (vLLM's LLM). Time limits
    asked for explicitly still apply."""
    llm = LLM(str(tiny_qwen2_vl), dtype="float32", enable_prefix_caching=False)
    limits = llm.engine.scheduler.config.limits
    assert not limits.time_sized and limits.max_tokens == TIME_SIZED_TOKEN_CAP
    assert not llm.engine.scheduler.cost_model.ready, "no calibration at start"
    prompts = [f"prompt number {i} " * 6 for i in range(6)]
    steps = []
    real_step = llm.engine.step

    def counting_step():
        steps.append(1)
        return real_step()

    llm.engine.step = counting_step
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * 6
    assert len(steps) == 4, "every prompt prefilled in the first step, then 3 decode steps"
    timed = LLM(str(tiny_qwen2_vl), dtype="float32", target_itl_ms="auto")
    assert timed.engine.scheduler.config.limits.target_itl_s == AUTO


def test_batch_only_steps_stay_under_the_step_bound(tiny_qwen2_vl):
    """Without interruptible steps (on by default: tests/engine/test_step_interrupt.py)."""
    _, eng = _engine(
        tiny_qwen2_vl, max_step_ms="30", enable_prefix_caching=False, interruptible_steps=False
    )
    alone = LLM(str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=4096)
    expected = alone.chat(_frame(7), FEW)[0].outputs[0].token_ids
    eng.add_request("cam", _frame(7), FEW, priority="batch")
    eng.add_request("report", text_conv("words " * 200), FEW, priority="batch")
    model = eng.scheduler.cost_model
    steps, biggest_chunk, outputs = 0, 0, {}
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        assert sched.target_s == pytest.approx(0.030), "the step bound applies to batch work"
        assert model.predict(sched.features) <= 0.030 + 1e-9
        biggest_chunk = max(biggest_chunk, sched.num_prefill_tokens)
        result = eng.runner.execute(sched)
        _, finished = eng.scheduler.update_from_output(
            sched, result.sampled, result.encoder_progress
        )
        outputs.update({r.request_id: r.output_token_ids for r in finished})
        steps += 1
    # 30 ms at 4 ms a step and 0.5 ms a token: ~50 tokens a step, not a block at a time
    assert biggest_chunk >= 40
    assert outputs["cam"] == expected, "sizing steps by time changes no token"


def test_an_arriving_interactive_request_goes_first_and_waits_no_batch_work(tiny_qwen2_vl):
    _, eng = _engine(tiny_qwen2_vl, enable_prefix_caching=False)
    eng.add_request("cam", _frame(11), FEW, priority="batch")
    # long enough to be mid-way after two interruptible steps (each runs many step bounds)
    eng.add_request("report", text_conv("words " * 1000), FEW, priority="batch")
    for _ in range(2):
        _run(eng, eng.scheduler.schedule())
    assert eng.scheduler.requests["report"].is_prefill, "batch prefill is mid-way"

    eng.add_request("chat", text_conv("hi there"), FEW, priority="interactive")
    sched = eng.scheduler.schedule()
    prefills = [c.request_id for c in sched.chunks if not c.is_decode]
    assert prefills == ["chat"], "the chat prompt alone: no batch prefill beside it"
    assert not sched.encoder_work, "and no batch encoder work"
    _run(eng, sched)

    # while the chat stream decodes, batch work fills what the auto ITL target leaves: 1.25x
    # the step's decodes (the chat's, and the camera's once its prompt is done)
    for _ in range(2):
        sched = eng.scheduler.schedule()
        assert sched.chunks[0].request_id == "chat" and sched.chunks[0].is_decode
        decodes = [c for c in sched.chunks if c.is_decode]
        decode_only = eng.scheduler.cost_model.predict(
            StepFeatures(
                decode_tokens=len(decodes), attention_units=sum(c.start + 1 for c in decodes)
            )
        )
        assert sched.target_s == pytest.approx(1.25 * decode_only, rel=0.05)
        assert eng.scheduler.cost_model.predict(sched.features) <= sched.target_s + 1e-9
        _run(eng, sched)


@pytest.mark.parametrize("max_step_ms", ["60", "500"])
def test_a_waiting_chat_prompt_beside_chat_decodes_gets_more_than_the_itl_target(
    tiny_qwen2_vl, max_step_ms
):
    """The ITL target protects chat from camera work; applied between chat requests it starved
    the waiting ones (eight chats at once: 30 % below a fixed 2,048-token budget's throughput,
    ``benchmarks.default_cost``). A chat prompt beside chat decodes gets 3x their decode step
    (never the 5x of a stall, however long the step bound), within the step bound; a batch
    prompt in the same step is still held to the ITL target."""
    _, eng = _engine(tiny_qwen2_vl, max_step_ms=max_step_ms, enable_prefix_caching=False)
    long_chat = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("chat0", text_conv("hello"), long_chat, priority="interactive")
    while eng.scheduler.requests["chat0"].is_prefill or eng.scheduler.waiting:
        _run(eng, eng.scheduler.schedule())
    model = eng.scheduler.cost_model

    eng.add_request("chat1", text_conv("words " * 60), long_chat, priority="interactive")
    sched = eng.scheduler.schedule()
    decode = next(c for c in sched.chunks if c.request_id == "chat0")
    decode_only = model.predict(StepFeatures(decode_tokens=1, attention_units=decode.start + 1))
    chunk = sum(c.num_tokens for c in sched.chunks if c.request_id == "chat1")
    assert sched.target_s == pytest.approx(3 * decode_only)  # 15 ms, under either bound
    assert 1.25 * decode_only < model.predict(sched.features) <= sched.target_s + 1e-9
    # 10 ms left at 0.5 ms a token: ~20 tokens, where the ITL target left ~2
    assert chunk >= 15, f"a {chunk}-token chunk: the waiting chat crawls"
    _run(eng, sched)

    # a camera prompt arriving now waits behind the chat prompt, then fills only what the ITL
    # target leaves
    eng.add_request("cam", text_conv("frame " * 60), FEW, priority="batch")
    cam_steps = 0
    for _ in range(24):
        sched = eng.scheduler.schedule()
        if any(c.request_id == "cam" for c in sched.chunks):
            cam_steps += 1
            assert sched.target_s < 2 * decode_only  # 1.25 x this step's decodes
            assert model.predict(sched.features) <= sched.target_s + 1e-9
        _run(eng, sched)
    assert cam_steps >= 1


def test_chat_prompts_sent_together_share_one_step_while_no_chat_decodes(tiny_qwen2_vl):
    """Nobody to stall: chat prompts that arrive while no chat stream decodes are prefilled in
    one step past the step bound (a chat arriving meanwhile waits behind them whatever the
    step size), camera work in that step waits; once chats decode, a new chat's prompt is
    chunked beside them again. Eight chats at once cost 13.5 % of a fixed budget's
    throughput when the bound chunked them (``benchmarks.default_cost``). Short batch steps
    (interruptible ones would prefill the camera prompt whole before the chats arrive)."""
    _, eng = _engine(
        tiny_qwen2_vl, max_step_ms="30", enable_prefix_caching=False, interruptible_steps=False
    )
    model = eng.scheduler.cost_model
    eng.add_request("cam", text_conv("frame " * 60), FEW, priority="batch")
    _run(eng, eng.scheduler.schedule())
    assert eng.scheduler.requests["cam"].is_prefill, "the camera prompt is mid-way"

    chats = [f"chat{i}" for i in range(4)]
    for i, rid in enumerate(chats):
        eng.add_request(rid, text_conv(f"question {i} " + "words " * 40), FEW, "interactive")
    sched = eng.scheduler.schedule()
    prefilled = {c.request_id: c.num_tokens for c in sched.chunks if not c.is_decode}
    assert prefilled == {rid: len(eng.scheduler.requests[rid].prompt_token_ids) for rid in chats}, (
        "every chat prompt whole, no camera chunk beside them"
    )
    assert model.predict(sched.features) > 0.030, "past the step bound"
    _run(eng, sched)

    eng.add_request("late", text_conv("words " * 60), FEW, priority="interactive")
    sched = eng.scheduler.schedule()
    assert sum(c.is_decode for c in sched.chunks) == len(chats)
    assert model.predict(sched.features) <= 0.030 + 1e-9, "the step bound again"
    late = sum(c.num_tokens for c in sched.chunks if c.request_id == "late")
    assert 0 < late < len(eng.scheduler.requests["late"].prompt_token_ids), "chunked"


def _frames_queued(checkpoint, max_deferred_steps: int = 16):
    """Two camera frames queued at once, the tower priced so that an encode spans steps
    (short steps: an interruptible one would encode b beside a's prompt)."""
    _, eng = _engine(
        checkpoint, max_step_ms="30", enable_prefix_caching=False, interruptible_steps=False
    )
    eng.scheduler.cost_model = StepCostModel(coefficients={**SYNTHETIC, "encoder_kunits": 0.05})
    eng.scheduler.config.max_deferred_steps = max_deferred_steps
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, rid in enumerate(("a", "b")):
        eng.add_request(rid, _frame(21 + i), params, priority="batch")
    return eng, params


def _drive(eng) -> tuple[list, dict[str, list[int]]]:
    """Run to the end; per step (decoding ids, prompt tokens, encoder work?, held decodes)."""
    steps, outputs = [], {}
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        decoding = {c.request_id for c in sched.chunks if c.is_decode}
        steps.append((decoding, sched.num_prefill_tokens, bool(sched.encoder_work), sched))
        result = eng.runner.execute(sched)
        _, finished = eng.scheduler.update_from_output(
            sched, result.sampled, result.encoder_progress
        )
        outputs.update({r.request_id: r.output_token_ids for r in finished})
    return steps, outputs


def test_a_camera_decode_waits_out_encoder_only_steps_for_a_step_with_prompt_rows(
    tiny_qwen2_vl,
):
    """Frame a decodes while frame b is encoded: a step that would run the decoder for a's
    one token beside encoder work alone holds it (a whole weight pass for one row, and
    camera-only work 5 % below a fixed budget); it rides the next step with prompt rows.
    Tokens are unchanged."""
    eng, params = _frames_queued(tiny_qwen2_vl)
    alone = LLM(str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=4096)
    expected = [o.outputs[0].token_ids for o in alone.chat([_frame(21), _frame(22)], params)]
    steps, outputs = _drive(eng)
    held = [s for s in steps if s[3].held_decodes]
    assert held, "a's decode sat out b's encoding"
    for decoding, prompt_tokens, encoding, sched in held:
        assert not decoding and not prompt_tokens and encoding
        assert sched.features.decode_tokens == 0, "nor is it priced"
    a_decodes = [s for s in steps if "a" in s[0]]
    assert any(prompt_tokens for _, prompt_tokens, _, _ in a_decodes), "rides b's prompt"
    assert [outputs["a"], outputs["b"]] == expected


def test_a_held_camera_decode_runs_after_max_deferred_steps(tiny_qwen2_vl):
    eng, _ = _frames_queued(tiny_qwen2_vl, max_deferred_steps=1)
    steps, outputs = _drive(eng)
    assert any(s[3].held_decodes for s in steps)
    for before, after in itertools.pairwise(steps):
        assert not (before[3].held_decodes and after[3].held_decodes), "two in a row"
    assert len(outputs["a"]) == len(outputs["b"]) == 8


def test_an_interactive_image_is_encoded_before_batch_images(tiny_qwen2_vl):
    _, eng = _engine(tiny_qwen2_vl, enable_prefix_caching=False, encoder_rows_per_item=16)
    # encoder work priced so that a frame takes several 50 ms steps to encode
    eng.scheduler.cost_model = StepCostModel(coefficients={**SYNTHETIC, "encoder_kunits": 2.0})
    eng.add_request("cam", _frame(21), FEW, priority="batch")
    sched = eng.scheduler.schedule()
    cam_hash = eng.scheduler.requests["cam"].prompt.images[0].content_hash
    assert cam_hash in sched.encoder_work, "the camera frame starts encoding"
    _run(eng, sched)
    assert not eng.encoder_cache.ready(cam_hash), "and is still encoding"

    eng.add_request("look", _frame(22), FEW, priority="interactive")
    look_hash = eng.scheduler.requests["look"].prompt.images[0].content_hash
    sched = eng.scheduler.schedule()
    assert list(sched.encoder_work) == [look_hash], "the chat image's encoding, nothing else"


@pytest.mark.parametrize("max_step_ms", [None, "30"], ids=["auto", "explicit"])
def test_encoder_only_steps_stop_at_twice_the_decode_step(tiny_qwen2_vl, max_step_ms):
    """A frame encoding with nothing else beside it: under the "auto" step bound its
    encoder-only steps stop at ``encoder_only_factor`` x the decode step (a chat arriving
    while cameras run waits behind one of those most of the time), its prompt steps keep the
    whole bound (each re-reads the decoder's weights). An explicit --max-step-ms bounds both
    alike. (Steps that cannot be interrupted: with chat in the engine, or the option off;
    interruptible ones stop between items instead, tests/engine/test_step_interrupt.py.)"""
    kw = {} if max_step_ms is None else {"max_step_ms": max_step_ms}
    _, eng = _engine(
        tiny_qwen2_vl,
        enable_prefix_caching=False,
        encoder_rows_per_item=16,
        interruptible_steps=False,
        **kw,
    )
    eng.scheduler.cost_model = StepCostModel(coefficients={**SYNTHETIC, "encoder_kunits": 2.0})
    eng.add_request("cam", _frame(24), FEW, priority="batch")
    budget = eng.scheduler.new_budget()
    budget.open_prefill(interactive_decoding=False)
    bound, short = budget.step_bound_s(), budget.encoder_step_bound_s()
    if max_step_ms is None:
        assert short == pytest.approx(2 * budget.cost_model.predict(StepFeatures(decode_tokens=1)))
        assert short < bound / 2
    else:
        assert short == float("inf") and bound == pytest.approx(0.030)
    encoder_only, longest = 0, 0.0
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        # a prompt chunk starved for max_deferred_steps may stretch its step that far
        assert sched.predicted_s <= STARVED_STEP_STRETCH * bound + 1e-9
        if sched.encoder_work and not sched.num_prefill_tokens:
            encoder_only += 1
            longest = max(longest, sched.predicted_s)
            assert sched.predicted_s <= min(short, bound) + 1e-9
        _run(eng, sched)
    assert encoder_only >= 2, "the frame took several encoder-only steps"
    assert longest > 0.8 * min(short, bound), "and they were filled up to their bound"
    if max_step_ms is not None:
        return
    # a chat's own image is not held to it (its user waits for it): the whole step bound
    budget = eng.scheduler.new_budget()
    budget.open_prefill(interactive_decoding=False)
    per_unit = budget._seconds_per_encoder_unit()
    assert budget.encoder_allowance(batch=True) * per_unit < short
    assert budget.encoder_allowance(batch=False) * per_unit > short
    # an item priced above the short bound still runs, one a step, never starved
    costs = {**SYNTHETIC, "encoder_kunits": 2.0, "encoder_items": 2 * short}
    eng.scheduler.cost_model = StepCostModel(coefficients=costs)
    eng.add_request("cam2", _frame(25), FEW, priority="batch")
    sched = eng.scheduler.schedule()
    assert sched.encoder_work and sched.features.encoder_items == 1


def test_encoder_work_is_granted_net_of_its_per_item_cost(tiny_qwen2_vl):
    """A vision work item costs a fixed price on top of its units: the budget pays it before
    granting units, the runner is told it (in units) to charge every item it runs, and the
    step's prediction holds with the item counted in. (An explicit step bound: under "auto"
    encoder-only steps have a shorter one of their own, see the test above.)"""
    kw = {"enable_prefix_caching": False, "encoder_rows_per_item": 16, "max_step_ms": "50"}
    _, eng = _engine(tiny_qwen2_vl, **kw)
    per_item, per_kunit = 0.01, 0.05
    costs = {**SYNTHETIC, "encoder_kunits": per_kunit, "encoder_items": per_item}
    eng.scheduler.cost_model = StepCostModel(coefficients=costs)
    eng.add_request("cam", _frame(23), FEW, priority="batch")
    sched = eng.scheduler.schedule()
    cam_hash = eng.scheduler.requests["cam"].prompt.images[0].content_hash
    granted = sched.encoder_work[cam_hash]
    assert sched.encoder_item_overhead == pytest.approx(per_item / (per_kunit / 1e3))
    assert sched.features.encoder_items == 1
    assert sched.predicted_s == pytest.approx(
        eng.scheduler.cost_model.predict(sched.features), rel=1e-9
    )
    assert sched.predicted_s <= sched.target_s + 1e-9
    # the same step without the item price would have granted its worth more units
    fresh = _served(tiny_qwen2_vl, **kw)
    fresh.scheduler.cost_model = StepCostModel(coefficients={**costs, "encoder_items": 0.0})
    fresh.add_request("cam", _frame(23), FEW, priority="batch")
    plain = fresh.scheduler.schedule()
    assert plain.encoder_item_overhead == 0.0
    assert plain.encoder_work[cam_hash] == pytest.approx(granted + per_item / (per_kunit / 1e3))


def test_startup_log_states_the_step_policy(tiny_qwen2_vl, caplog):
    with caplog.at_level(logging.INFO, logger="engine.calibration"):
        _served(tiny_qwen2_vl)
        _served(tiny_qwen2_vl, max_num_batched_tokens=256)
    lines = [r.getMessage() for r in caplog.records if "step_policy" in r.getMessage()]
    assert len(lines) == 2
    assert "mode=time-sized" in lines[0] and "max_step=auto (" in lines[0]
    assert "ms; encoder-only steps " in lines[0]
    assert "itl_target=auto (" in lines[0] and "ms/token" in lines[0]
    assert "camera prompt tokens beside one chat stream (another chat's prompt" in lines[0]
    assert "mode=fixed-tokens max_num_batched_tokens=256" in lines[1]


def test_calibration_times_decodes_and_side_chunks_at_a_long_context(
    tiny_qwen2_vl, tmp_path, monkeypatch
):
    """The fit prices attention per key only if it saw decodes and small chunks at more than
    one context: calibration runs them at 64 keys and again near LONG_CONTEXT, capped by
    the model's length, and gives every block back."""
    import engine.calibration as calibration

    monkeypatch.setenv("VISION_SERVE_CACHE_DIR", str(tmp_path))
    recorded = []
    real = calibration.calibrate
    monkeypatch.setattr(
        calibration, "calibrate", lambda *a, **k: recorded.extend(real(*a, **k)) or recorded
    )
    eng = _served(tiny_qwen2_vl)
    long = calibration.LONG_CONTEXT - 100
    decodes = [f for f, _, _ in recorded if f.decode_tokens and not f.prefill_tokens]
    sides = [f for f, _, _ in recorded if f.decode_tokens == 4 and f.prefill_tokens]
    assert {f.decode_tokens for f in decodes if f.decode_attention_units > long} >= {1, 4}
    assert {f.decode_tokens for f in decodes if f.decode_attention_units < 100 * 16} >= {1, 16}
    assert {f.prefill_tokens for f in sides if f.chunk_keys > long} == {1, 4, 12}
    assert {f.prefill_tokens for f in sides if f.chunk_keys < 200} >= {1, 4, 12}
    assert eng.kv.num_free_blocks == eng.kv.num_blocks

    recorded.clear()
    monkeypatch.setenv("VISION_SERVE_CACHE_DIR", str(tmp_path / "short"))
    short = _served(tiny_qwen2_vl, max_model_len=256)
    assert recorded and short.scheduler.cost_model.ready
    assert all(f.decode_attention_units <= 256 * f.decode_tokens for f, _, _ in recorded)
    assert any(f.decode_attention_units > 150 * f.decode_tokens for f, _, _ in recorded)
    assert short.kv.num_free_blocks == short.kv.num_blocks


def test_calibration_is_cached_per_machine_model_and_dtype(tiny_qwen2_vl, tmp_path, monkeypatch):
    import engine.calibration as calibration

    monkeypatch.setenv("VISION_SERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_busy_load", lambda: None)  # whatever runs beside
    runs = []
    real = calibration.calibrate
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: runs.append(1) or real(*a, **k))
    first = _served(tiny_qwen2_vl).scheduler.cost_model
    assert len(runs) == 1 and first.ready
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1
    again = _served(tiny_qwen2_vl).scheduler.cost_model
    assert len(runs) == 1, "the second start reuses the calibration"
    assert again.coefficients() == pytest.approx(first.coefficients())
    _served(tiny_qwen2_vl, dtype="bfloat16")
    assert len(runs) == 2, "another dtype is another calibration"

    for path in (tmp_path / "calibration").glob("*.json"):
        path.write_text("{not json")
    assert _served(tiny_qwen2_vl).scheduler.cost_model.ready
    assert len(runs) == 3, "a corrupt cache is measured again, not trusted"


def test_a_calibration_timed_on_a_busy_machine_is_used_but_not_cached(
    tiny_qwen2_vl, tmp_path, monkeypatch, caplog
):
    """Steps timed while other work held the cores would set this machine's prices for every
    later start; they seed this engine only."""
    import engine.calibration as calibration

    monkeypatch.setenv("VISION_SERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    with caplog.at_level("WARNING", logger="engine.calibration"):
        model = _served(tiny_qwen2_vl).scheduler.cost_model
    assert model.ready
    assert not list(tmp_path.glob("calibration/*.json"))
    assert "calibration not cached: the machine was busy" in caplog.text


def test_a_starved_prefill_keeps_the_step_in_the_fused_kernel():
    """The starvation guard forces a chunk beside chat decodes; one that pushed the step past
    the fused kernel's rows would pay the eager floor (~100 ms on a 2-core AVX2 EPYC against a
    16 ms decode step) in every chat stream's ITL."""
    model = StepCostModel(coefficients={"fixed": 0.01, "decode_tokens": 0.001})
    fused = StepBudget(
        StepLimits(max_tokens=2048), model, fused_decode_rows=16, fused_prefill_rows=16
    )
    for _ in range(4):
        fused.add_decode(64)
    assert fused.starved_chunk(block_size=16) == 12
    # the first starved frame takes the spare rows; a second one waits rather than push the
    # step to 17 rows and into the eager path
    fused.add_chunk(16, 12)
    assert fused.features.prefill_tokens + fused.features.decode_tokens == 16
    assert fused.starved_chunk(block_size=16) == 0
    # decodes alone fill the kernel: any chunk makes the step eager, so it carries a block
    full = StepBudget(
        StepLimits(max_tokens=2048), model, fused_decode_rows=16, fused_prefill_rows=16
    )
    for _ in range(16):
        full.add_decode(64)
    assert full.starved_chunk(block_size=16) == 16
    plain = StepBudget(StepLimits(max_tokens=2048), model)
    plain.add_decode(64)
    assert plain.starved_chunk(block_size=16) == 16


def test_a_starved_prefill_stretches_the_step_only_so_far():
    """The guard is for liveness: under a time limit the forced chunk keeps the step within
    STARVED_STEP_STRETCH x the limit, one token at least. A block at a time beside four chat
    streams (every 17th step, one frame after another) had set the chat ITL p99 alone."""
    from engine.step_budget import STARVED_STEP_STRETCH

    model = StepCostModel(
        coefficients={"fixed": 0.01, "decode_tokens": 0.001, "prefill_tokens": 0.002}
    )

    def budget(limit_s: float | None) -> StepBudget:
        b = StepBudget(
            StepLimits(max_tokens=2048), model, fused_decode_rows=16, fused_prefill_rows=16
        )
        for _ in range(4):
            b.add_decode(64)  # 14 ms predicted
        b.limit_s = limit_s
        return b

    assert STARVED_STEP_STRETCH == 1.25
    assert budget(None).starved_chunk(block_size=16) == 12  # the kernel's spare rows
    assert budget(0.016).starved_chunk(block_size=16) == 3  # 14 + 3 x 2 ms <= 1.25 x 16
    assert budget(0.010).starved_chunk(block_size=16) == 1  # past the bound already: one
    plain = StepBudget(StepLimits(max_tokens=2048), model)
    plain.add_decode(64)
    plain.limit_s = 0.012
    assert plain.starved_chunk(block_size=16) == 2  # 11 + 2 x 2 ms <= 15 ms


def test_starved_frames_beside_chat_never_push_a_step_out_of_the_fused_kernel(tiny_qwen2_vl):
    """Three camera prompts starved by the ITL target beside four chat streams: the guard
    feeds each of them, but only through the fused kernel's spare rows, never one token each
    past them (an 18-row step went eager: 160-340 ms on a 2-core EPYC)."""
    _, eng = _engine(tiny_qwen2_vl, target_itl_ms="8.5")
    sched_cfg = eng.scheduler.config
    sched_cfg.fused_decode_rows = sched_cfg.fused_prefill_rows = 16  # as the CPU kernel sets
    chat = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    for i in range(4):
        eng.add_request(f"chat{i}", text_conv(f"chat {i}"), chat)
    while any(r.is_prefill for r in eng.scheduler.running) or eng.scheduler.waiting:
        _run(eng, eng.scheduler.schedule())
    # prompt tokens now cost more than the target leaves beside four decodes
    eng.scheduler.cost_model = StepCostModel(
        coefficients={"fixed": 0.004, "decode_tokens": 0.001, "prefill_tokens": 0.01}
    )
    for i in range(3):
        eng.add_request(f"cam{i}", text_conv("frame " * 40), FEW, priority="batch")
    fed = 0
    for _ in range(3 * (sched_cfg.max_deferred_steps + 2)):
        sched = eng.scheduler.schedule()
        rows = sched.num_prefill_tokens + sched.num_decode_tokens
        assert rows <= 16, f"a {rows}-row step leaves the fused kernel"
        fed += sched.num_prefill_tokens
        _run(eng, sched)
    # liveness, not throughput: every frame moves (a token at a time here, since one more
    # prompt token costs past STARVED_STEP_STRETCH x the target beside four decodes)
    assert fed >= 3, "the starvation guard still feeds the frames"
    assert all(eng.scheduler.requests[f"cam{i}"].num_computed_tokens > 0 for i in range(3))


def test_a_camera_prompt_queued_behind_a_progressing_one_is_not_forced_in(tiny_qwen2_vl):
    """Two camera prompts beside a chat stream, the ITL target leaving room for a few prompt
    tokens a step: the older takes that room every step and the younger waits its turn
    (first come, first served). The starvation guard is for a class that gets nothing: six
    frames beside four chat streams each forced a block or an encoder item every 17th step
    out of the older frames' share, and all six finished late together."""
    _, eng = _engine(tiny_qwen2_vl, target_itl_ms="8.5", enable_prefix_caching=False)
    chat = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    eng.add_request("chat", text_conv("chat"), chat)
    while any(r.is_prefill for r in eng.scheduler.running) or eng.scheduler.waiting:
        _run(eng, eng.scheduler.schedule())
    for rid in ("older", "younger"):
        eng.add_request(rid, text_conv("frame " * 150), FEW, priority="batch")
    older, younger = (eng.scheduler.requests[rid] for rid in ("older", "younger"))
    for _ in range(eng.scheduler.config.max_deferred_steps + 4):
        before = older.num_computed_tokens
        _run(eng, eng.scheduler.schedule())
        assert older.is_prefill and older.num_computed_tokens > before, "older: every step"
        assert younger.num_computed_tokens == 0, "younger: after the older one"


def test_the_pace_follows_measured_over_predicted_within_its_clip():
    pace = BesideChatPace()
    for _ in range(200):
        pace.observe(0.0164, 0.0184)  # steps ran 11 % under their prediction
    assert pace.ratio == pytest.approx(0.0164 / 0.0184, rel=1e-3)
    for _ in range(200):
        pace.observe(0.1, 0.01)  # a stalled front end: clipped, never 10x
    assert pace.ratio == pytest.approx(pace.high, rel=1e-3)
    pace.observe(0.01, 0.0)  # no prediction: no sample
    assert pace.ratio == pytest.approx(pace.high, rel=1e-3)


def test_batch_room_beside_chat_is_paced_by_how_such_steps_ran(tiny_qwen2_vl):
    """Steps with camera work beside chat that ran under their prediction give the next ones
    more room (the ITL target is in measured seconds); steps without batch work, or without
    chat decoding, do not move the pace."""
    _, eng = _engine(tiny_qwen2_vl, target_itl_ms="8.5", enable_prefix_caching=False)
    chat = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    eng.add_request("chat", text_conv("chat"), chat)
    while any(r.is_prefill for r in eng.scheduler.running) or eng.scheduler.waiting:
        sched = eng.scheduler.schedule()
        assert not sched.paced, "a chat's own prompt is not batch work"
        eng.scheduler.observe_step(sched, 10.0)
        _run(eng, sched)
    assert eng.scheduler.pace.ratio == 1.0
    eng.add_request("cam", text_conv("frame " * 150), FEW, priority="batch")
    sched = eng.scheduler.schedule()
    assert sched.paced and sched.target_s == pytest.approx(0.0085)
    unpaced_tokens = sched.num_prefill_tokens
    _run(eng, sched)
    for _ in range(200):
        eng.scheduler.observe_step(sched, 0.8 * sched.predicted_s)
    sched = eng.scheduler.schedule()
    assert sched.paced and sched.target_s == pytest.approx(0.0085 / 0.8, rel=1e-3)
    assert sched.num_prefill_tokens > unpaced_tokens


# ---- the fused kernel's GEMV and oneDNN's GEMM past it ----------------------------------------
GEMV_JUMP = {"fixed": 0.001, "lm_forward": 0.012, "decode_tokens": 0.0005,
             "prefill_tokens": 0.0005, "past_gemv": 0.01}  # fmt: skip


def _beside_four_decodes(limit_s: float | None, gemv_rows: int = 16) -> StepBudget:
    """A fused step (AMX-like: GEMV to 16 rows, packed GEMM to 256) with 4 chat decodes."""
    b = StepBudget(
        StepLimits(max_tokens=2048),
        StepCostModel(coefficients=GEMV_JUMP),
        fused_decode_rows=256,
        fused_prefill_rows=256,
        gemv_rows=gemv_rows,
    )
    for _ in range(4):
        b.add_decode(64)
    if limit_s is not None:  # batch work beside chat: the ITL target
        b.itl_target_s = limit_s
        b.restrict_to_itl()
    return b


def test_the_cost_model_prices_the_step_past_the_kernels_gemv_as_a_jump():
    """Past ``gemv_rows`` the fused kernel's linears call oneDNN's GEMM: a jump in step time
    (2-core AMX Xeon: 4 decodes + 12 prompt rows 22.6 ms, + 13 rows 32.8) that no hinge can
    price; the feature is set only where the kernel runs the step and switches."""

    def features(prefill: int, decodes: int = 4, **kw) -> StepFeatures:
        base = {"fused_decode_rows": 256, "fused_prefill_rows": 256, "gemv_rows": 16} | kw
        return StepFeatures(prefill_tokens=prefill, decode_tokens=decodes, **base)

    assert not features(12).past_gemv
    assert features(13).past_gemv
    assert features(0, decodes=17).past_gemv  # decode-only steps switch too
    assert not features(13, gemv_rows=0).past_gemv  # no packed weights: the GEMV takes all
    assert not features(13, force_eager=True).past_gemv  # an eager forward: no kernel at all
    assert not features(300).past_gemv  # past fused_prefill_rows: eager, priced as such
    # fitted from steps on both sides of the switch, the model learns the jump, not a slope
    model = StepCostModel(min_samples=4)
    for rep in range(3):
        for k in (0, 2, 4, 8, 12, 13, 16, 24, 32):
            seconds = 0.014 + 0.0005 * k + (0.01 if k + 4 > 16 else 0.0)
            model.observe(features(k), seconds * (1 + 0.001 * rep))
    model.refit()
    jump = model.predict(features(13)) - model.predict(features(12))
    assert 0.008 < jump < 0.012, model.coefficients()


def test_camera_chunks_beside_chat_stay_in_the_kernels_gemv():
    """A limit that admits 20 prompt rows beside 4 chat decodes gives a camera prompt the
    GEMV's 12 (more tokens per predicted second: 6 ms for 12 against 20 ms for 20); a chat
    prompt, whose user waits for all of it, still gets the 20, and so does a camera prompt
    in a step of its own (that step's base is paid for the camera: cut in two, twice)."""
    assert _beside_four_decodes(0.0352).fit_chunk(64, 500) == 12
    assert _beside_four_decodes(0.0352).fit_chunk(64, 500, interactive=True) == 20
    alone = _beside_four_decodes(None)
    alone.limit_s = 0.0352
    assert alone.fit_chunk(64, 500) == 20
    # without the switch (the emulated builds' panel GEMV takes every row) nothing is cut
    assert _beside_four_decodes(0.0352, gemv_rows=0).fit_chunk(64, 500) == 40


def test_a_starved_prefill_beside_chat_stays_in_the_kernels_gemv():
    """The starvation guard's forced chunk keeps the step in the GEMV: a forced 16-token block
    beside 4 chat decodes ran 51 ms against a 33 ms target on a 2-core AMX Xeon (the
    oneDNN floor), 12 rows would have run ~23."""
    budget = _beside_four_decodes(None)
    assert budget.starved_chunk(block_size=16) == 12
    budget.add_chunk(64, 12)
    assert budget.starved_chunk(block_size=16) == 0  # the chunk above took the spare rows
    full = _beside_four_decodes(None)
    for _ in range(12):
        full.add_decode(64)  # the decodes alone fill the GEMV: a block, as before
    assert full.starved_chunk(block_size=16) == 16
