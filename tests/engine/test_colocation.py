"""Co-location policy: interactive first, batch by deadline, prefix reuse, an ITL-sized budget.

Timing-dependent behaviour is driven with a fake clock and a synthetic cost model; output
equality uses the real tiny model.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.cost_model import StepCostModel, StepFeatures
from tests.engine.helpers import SYNTHETIC_COSTS, image_conv, noise_image, text_conv

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(checkpoint, clock=None, **kw):
    llm = LLM(str(checkpoint), dtype="float32", **kw)
    if clock is not None:
        llm.engine.scheduler.clock = clock
    return llm, llm.engine


def _run_to_completion(eng) -> dict[str, list[int]]:
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _frame_conv(seed=31):
    return image_conv("Describe everyone in view.", noise_image(224, 168, seed=seed))


def test_interactive_request_is_scheduled_the_step_after_it_arrives(tiny_qwen2_vl):
    llm, eng = _engine(tiny_qwen2_vl, max_num_batched_tokens=8)
    alone = llm.chat(_frame_conv(), GREEDY)[0].outputs[0].token_ids

    llm, eng = _engine(tiny_qwen2_vl, max_num_batched_tokens=8, enable_prefix_caching=False)
    eng.add_request("cam", _frame_conv(), GREEDY, priority="batch")
    eng.step()
    eng.step()
    cam = eng.scheduler.requests["cam"]
    assert 0 < cam.num_computed_tokens < cam.num_prompt_tokens, "batch prefill is mid-way"
    eng.add_request("chat", text_conv("hi"), GREEDY, priority="interactive")
    sched = eng.scheduler.schedule()
    ids = [c.request_id for c in sched.chunks]
    assert ids[0] == "chat", "the waiting interactive request takes the budget first"
    assert sum(c.num_tokens for c in sched.chunks if c.request_id == "chat") == 8
    result = eng.runner.execute(sched)
    eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)
    assert eng.scheduler.requests["cam"].num_computed_tokens > 0, "paused, KV kept"
    done = _run_to_completion(eng)
    assert done["cam"] == alone


@pytest.mark.parametrize("time_sized", [True, False])
def test_a_chat_prompts_step_carries_no_batch_work_under_time_sized_steps(
    tiny_qwen2_vl, time_sized
):
    """Under steps sized by time, the step that prefills a chat's prompt carries no camera
    prompt chunk and no camera encoding (its first token waits for nothing batch); the camera
    goes on beside the chat's decodes. A fixed token budget shares the step as before."""
    kw = {"max_step_ms": "30", "interruptible_steps": False} if time_sized else {}
    budget = {} if time_sized else {"max_num_batched_tokens": 256}
    _, eng = _engine(tiny_qwen2_vl, enable_prefix_caching=False, **kw, **budget)
    eng.scheduler.cost_model = StepCostModel(coefficients=SYNTHETIC_COSTS)
    assert eng.scheduler.config.limits.time_sized == time_sized
    frames = {"cam": _frame_conv(), "cam2": _frame_conv(seed=32)}
    for rid, conv in frames.items():
        eng.add_request(rid, conv, GREEDY, priority="batch")
    eng.step()
    cam = eng.scheduler.requests["cam"]
    assert cam.num_computed_tokens < cam.num_prompt_tokens, "the camera is mid-way"
    eng.add_request("chat", text_conv("hi there"), GREEDY, priority="interactive")
    sched = eng.scheduler.schedule()
    prompts = [c.request_id for c in sched.chunks if not c.is_decode]
    assert prompts[0] == "chat"
    if time_sized:
        assert prompts == ["chat"] and not sched.encoder_work, "nothing batch beside it"
    else:
        assert set(prompts) > {"chat"}, "a fixed budget shares the step"
    result = eng.runner.execute(sched)
    eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)
    assert eng.scheduler.requests["chat"].output_token_ids, "its first token, in that step"
    if time_sized:
        sched = eng.scheduler.schedule()
        assert any(c.request_id == "chat" and c.is_decode for c in sched.chunks)
        assert sched.encoder_work or {c.request_id for c in sched.chunks} & set(frames), (
            "the camera goes on beside the chat's decodes"
        )
        result = eng.runner.execute(sched)
        eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)
    done = _run_to_completion(eng)
    alone = LLM(str(tiny_qwen2_vl), dtype="float32")
    for rid, conv in frames.items():
        assert done[rid] == alone.chat(conv, GREEDY)[0].outputs[0].token_ids, rid


def test_expired_batch_requests_cost_no_compute_and_are_counted(tiny_qwen2_vl):
    clock = FakeClock()
    _, eng = _engine(tiny_qwen2_vl, clock, max_num_batched_tokens=16)
    eng.add_request("chat", text_conv("a long answer please " * 4), GREEDY)
    for i in range(3):
        eng.add_request(
            f"cam{i}",
            _frame_conv(40 + i),
            GREEDY,
            priority="batch",
            deadline_s=0.5,
            arrival_time=clock.now,
        )
    eng.add_request(
        "cam-patient",
        _frame_conv(50),
        GREEDY,
        priority="batch",
        deadline_s=1e6,
        arrival_time=clock.now,
    )
    clock.now += 1.0  # every cam deadline but the patient one has passed, none started
    seen = set()
    outputs = {}
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        seen |= {c.request_id for c in sched.chunks}
        assert not any(j for j in sched.encoder_jobs if j.content_hash is None)
        result = eng.runner.execute(sched) if not sched.is_empty else None
        _, finished = eng.scheduler.update_from_output(
            sched, result.sampled if result else {}, result.encoder_progress if result else None
        )
        for req in finished:
            outputs[req.request_id] = req.status.value
    assert not seen & {"cam0", "cam1", "cam2"}, "expired requests never reach the model"
    assert {outputs[f"cam{i}"] for i in range(3)} == {"expired"}
    assert outputs["cam-patient"] == "length"
    assert eng.scheduler.num_expired == 3


def test_preemption_takes_batch_work_first_newest_first(tiny_qwen2_vl):
    convs = {
        "chat0": text_conv("interactive one " * 3),
        "chat1": text_conv("interactive two " * 3),
        "cam0": text_conv("batch one " * 3),
        "cam1": text_conv("batch two " * 3),
    }
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm, _ = _engine(tiny_qwen2_vl, block_size=4)
    reference = {k: llm.chat(c, params)[0].outputs[0].token_ids for k, c in convs.items()}

    _, eng = _engine(tiny_qwen2_vl, block_size=4, num_kv_blocks=48, enable_prefix_caching=False)
    for i, (rid, conv) in enumerate(convs.items()):
        eng.add_request(
            rid,
            conv,
            params,
            priority="batch" if rid.startswith("cam") else None,
            arrival_time=100.0 + i,
        )
    preempted_order = []
    done = {}
    while eng.has_unfinished():
        running_before = [r.request_id for r in eng.scheduler.running]
        sched = eng.scheduler.schedule()
        if sched.preempted_ids and not preempted_order:
            batch_running = [r for r in running_before if r.startswith("cam")]
            assert batch_running, "batch work was running: it must be the first victim"
            assert sched.preempted_ids[0] == max(batch_running), "newest batch request first"
        preempted_order += sched.preempted_ids
        result = eng.runner.execute(sched)
        _, finished = eng.scheduler.update_from_output(
            sched, result.sampled, result.encoder_progress
        )
        done.update({r.request_id: r.output_token_ids for r in finished})
    assert preempted_order, "the pool must be too small for all four"
    first_chat = next((i for i, r in enumerate(preempted_order) if r.startswith("chat")), None)
    if first_chat is not None:
        assert preempted_order[:first_chat], "interactive work is preempted only after batch"
    assert done == reference


def test_prefix_cache_hits_for_repeated_system_prompt_and_image(tiny_checkpoint):
    system = {"role": "system", "content": "You watch the loading dock cameras. " * 6}
    frame = noise_image(224, 224, seed=77)
    llm, eng = _engine(tiny_checkpoint)
    cold = LLM(str(tiny_checkpoint), dtype="float32", enable_prefix_caching=False)

    first = [system, {"role": "user", "content": "Is anyone at the dock?"}]
    second = [system, {"role": "user", "content": "Any trucks?"}]
    expected = [o.outputs[0].token_ids for o in cold.chat([first, second], GREEDY)]
    out1 = llm.chat(first, GREEDY)[0]
    before = eng.get_stats().prefix_cache_hits
    out2 = llm.chat(second, GREEDY)[0]
    assert eng.get_stats().prefix_cache_hits - before >= 16 * 3, "system prompt reused"
    assert out2.num_cached_tokens >= 48
    assert [out1.outputs[0].token_ids, out2.outputs[0].token_ids] == expected

    conv = image_conv("Who is this?", frame)
    ref = cold.chat(conv, GREEDY)[0].outputs[0].token_ids
    llm.chat(conv, GREEDY)
    misses = eng.get_stats().encoder_cache_misses
    again = llm.chat(image_conv("Who is this?", frame.copy()), GREEDY)[0]
    assert again.num_cached_tokens >= again.num_image_tokens, "the frame's blocks were reused"
    assert eng.get_stats().encoder_cache_misses == misses, "and not re-encoded"
    assert again.outputs[0].token_ids == ref


SYNTHETIC = SYNTHETIC_COSTS


@pytest.mark.parametrize("target_ms", [10.0, 20.0])
def test_adaptive_budget_keeps_predicted_step_under_target(tiny_qwen2_vl, target_ms):
    _, eng = _engine(tiny_qwen2_vl, max_num_batched_tokens=512, target_itl_ms=str(target_ms))
    model = StepCostModel(coefficients=SYNTHETIC)
    eng.scheduler.cost_model = model
    chat = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request("chat", text_conv("hello"), chat)
    eng.step()  # chat prefill
    eng.add_request(
        "cam", _frame_conv(90), SamplingParams(temperature=0, max_tokens=2), priority="batch"
    )
    eng.add_request(
        "cam2",
        text_conv("report " * 150),
        SamplingParams(temperature=0, max_tokens=2),
        priority="batch",
    )
    capped_steps, full_steps = 0, 0
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        chat_decoding = any(c.request_id == "chat" and c.is_decode for c in sched.chunks)
        if chat_decoding:
            assert sched.target_s == pytest.approx(target_ms / 1e3)
            assert model.predict(sched.features) <= target_ms / 1e3 + 1e-9
            if sched.num_prefill_tokens:
                capped_steps += 1
        elif sched.num_prefill_tokens:
            assert sched.target_s is None
            full_steps += 1
            remaining = sum(
                r.num_tokens - r.num_computed_tokens
                for r in eng.scheduler.waiting + eng.scheduler.running
                if r.is_prefill
            )
            assert sched.num_prefill_tokens == min(512, remaining), "full budget without chat"
        result = eng.runner.execute(sched)
        eng.step_outputs = eng.scheduler.update_from_output(
            sched, result.sampled, result.encoder_progress
        )
    assert capped_steps > 0 and full_steps > 0


def test_auto_target_follows_the_decode_only_step(tiny_qwen2_vl):
    _, eng = _engine(tiny_qwen2_vl, max_num_batched_tokens=512, target_itl_ms="auto")
    eng.scheduler.cost_model = StepCostModel(coefficients=SYNTHETIC)
    eng.add_request("chat", text_conv("hello"), SamplingParams(max_tokens=10, ignore_eos=True))
    eng.step()
    eng.add_request("cam", text_conv("x " * 200), SamplingParams(max_tokens=1), priority="batch")
    chat_context = eng.scheduler.requests["chat"].num_computed_tokens
    sched = eng.scheduler.schedule()
    decode_only = eng.scheduler.cost_model.predict(
        StepFeatures(decode_tokens=1, attention_units=chat_context + 1)
    )
    assert sched.target_s == pytest.approx(1.25 * decode_only, rel=1e-6)
    assert 0 < sched.num_prefill_tokens < 200


def test_cost_model_learns_a_linear_step_time():
    model = StepCostModel(refit_every=1, refit_interval_s=0)
    truth = StepCostModel(coefficients=SYNTHETIC)
    for i in range(40):
        f = StepFeatures(
            prefill_tokens=(i * 37) % 300,
            decode_tokens=i % 9,
            attention_units=(i * 1000) % 7000,
            encoder_units=(i % 5) * 6400.0,
        )
        model.observe(f, truth.predict(f))
    # every step here has 9+ rows, so per-token prices and the 8-row hinge are one line the
    # fit may split either way: what must hold are the separable prices and the predictions
    for name in ("fixed", "attention_kunits", "encoder_kunits"):
        assert model.coefficients()[name] == pytest.approx(SYNTHETIC[name], rel=1e-3, abs=1e-7)
    for probe in (
        StepFeatures(prefill_tokens=100, decode_tokens=3, attention_units=5000),
        StepFeatures(decode_tokens=12, attention_units=900, encoder_units=3000.0),
        StepFeatures(encoder_units=6400.0),
    ):
        assert model.predict(probe) == pytest.approx(truth.predict(probe), rel=1e-3)


def test_encoder_prices_are_fitted_on_the_encoders_own_time():
    """Encoder work beside decodes on a shared machine: the decode part of the step is noisy
    (here +-30 %), more than a few ms of encoder work. Fitted on the encoder's own time, its
    per-unit and per-item prices come out exact, and the decode price is learnt from the
    step's remainder; fitted on whole steps they would carry the decode part's noise."""
    rng = np.random.default_rng(0)
    model = StepCostModel(refit_every=1, refit_interval_s=0)
    per_kunit, per_item, decode = 0.04, 0.003, 0.020
    for i in range(200):
        items = 1 + i % 3
        f = StepFeatures(decode_tokens=4, encoder_units=float(20 + (i * 37) % 300) * items)
        f.encoder_items = items
        encoder_s = per_kunit * f.encoder_units / 1e3 + per_item * items
        step_s = decode * rng.uniform(0.7, 1.3) + encoder_s
        model.observe(f, step_s, encoder_s)
    coef = model.coefficients()
    assert coef["encoder_kunits"] == pytest.approx(per_kunit, rel=1e-6)
    assert coef["encoder_items"] == pytest.approx(per_item, rel=1e-6)
    assert model.predict(StepFeatures(decode_tokens=4)) == pytest.approx(decode, rel=0.1)


def test_cost_model_learns_that_a_few_rows_ride_along_for_free():
    """Roofline-shaped truth: weights streamed once per step, rows past the ridge cost FLOPs.
    A straight line through decode-only steps and big chunks would price a 12-token chunk at
    the big-chunk rate; the hinge features must recover the flat start."""
    model = StepCostModel(refit_every=1, refit_interval_s=0)

    def truth(f: StepFeatures) -> float:
        rows = f.prefill_tokens + f.decode_tokens
        return 0.010 + 0.0004 * max(0, rows - 10) + 0.00002 * f.attention_units / 1e3

    samples = [StepFeatures(decode_tokens=d, attention_units=300 * d) for d in range(1, 7)]
    samples += [StepFeatures(prefill_tokens=p, attention_units=p * p / 2) for p in (256, 512)]
    samples += [StepFeatures(decode_tokens=4, prefill_tokens=p) for p in (2, 4, 20, 28, 40, 60)]
    for f in samples * 3:
        model.observe(f, truth(f))
    for probe in (
        StepFeatures(decode_tokens=4, prefill_tokens=4),
        StepFeatures(prefill_tokens=300),
    ):
        assert model.predict(probe) == pytest.approx(truth(probe), rel=0.1)


def test_cost_model_learns_the_eager_forward_premium():
    """With the fused decode kernel, decode-only steps of <= 8 rows skip the eager path's
    per-op overhead; steps with prefill pay it. The fit must price that jump, not smear it
    over the per-token rates."""
    f = StepFeatures(decode_tokens=4, fused_decode_rows=8)
    assert not f.eager_forward
    assert f.plus(StepFeatures(prefill_tokens=2)).eager_forward
    assert StepFeatures(decode_tokens=9, fused_decode_rows=8).eager_forward
    assert StepFeatures(decode_tokens=4, fused_decode_rows=8, force_eager=True).eager_forward
    assert not StepFeatures(prefill_tokens=5).eager_forward  # no kernel: no premium

    def truth(f: StepFeatures) -> float:
        return (
            0.006 + 0.0002 * f.decode_tokens + 0.0001 * f.prefill_tokens + 0.007 * (f.eager_forward)
        )

    model = StepCostModel(refit_every=1, refit_interval_s=0)
    samples = [StepFeatures(decode_tokens=d, fused_decode_rows=8) for d in range(1, 9)]
    samples += [
        StepFeatures(decode_tokens=4, prefill_tokens=p, fused_decode_rows=8) for p in (2, 8, 32)
    ]
    samples += [StepFeatures(decode_tokens=d, fused_decode_rows=8) for d in (12, 16)]
    for f in samples * 2:
        model.observe(f, truth(f))
    assert model.coefficients()["eager_forward"] == pytest.approx(0.007, rel=1e-3)


def test_cost_model_prices_prompt_rows_beside_decodes_apart():
    """A prompt row beside decodes costs more than one alone (measured on an AMX Xeon: 4
    decodes + 8 prompt rows 17 ms against 14 predicted from prompt-only and decode-only
    prices). With calibration's shapes (prompt-only chunks, decode-only batches, chunks
    beside 4 decodes) the fit must learn that surcharge, or the ITL target admits camera rows
    it cannot afford."""

    def truth(f: StepFeatures) -> float:
        mixed = f.prefill_tokens > 0 and f.decode_tokens > 0
        return (
            0.010
            + 0.0003 * f.prefill_tokens
            + 0.0008 * f.decode_tokens
            + mixed * (0.002 + 0.0004 * f.prefill_tokens)
        )

    model = StepCostModel(refit_every=1, refit_interval_s=0)
    samples = [StepFeatures(prefill_tokens=p) for p in (8, 16, 32, 64, 128, 256)]
    samples += [StepFeatures(decode_tokens=d) for d in (1, 2, 4, 8, 16)]
    samples += [StepFeatures(decode_tokens=4, prefill_tokens=p) for p in (1, 2, 4, 8, 16, 32)]
    for f in samples * 2:
        model.observe(f, truth(f))
    for probe in (
        StepFeatures(decode_tokens=4, prefill_tokens=6),
        StepFeatures(decode_tokens=3, prefill_tokens=12),
        StepFeatures(prefill_tokens=100),
        StepFeatures(decode_tokens=4),
    ):
        assert model.predict(probe) == pytest.approx(truth(probe), rel=0.03)


def test_cost_model_prices_keys_of_decodes_and_small_chunks_apart_from_prefill_attention():
    """A decode row pays per key of its context, a small prompt chunk about once per key
    whatever its rows, a long prompt chunk little per query-key pair (flash attention). With
    calibration's shapes, the decode and side-chunk ones at a short and a long context, the
    fit must price the long-context steps a camera's chunks beside chat are: one price per
    query-key pair fitted 0 (the prefill steps' cheap quadratic attention set it) and a
    decode step at 1,024 keys ran 2-3 ms over its prediction on a 2-core AMX Xeon."""

    def truth(f: StepFeatures) -> float:
        mixed = f.prefill_tokens > 0 and f.decode_tokens > 0
        return (
            0.010
            + 0.0003 * f.prefill_tokens
            + 0.0008 * f.decode_tokens
            + 2e-9 * f.attention_units
            + 7e-7 * f.decode_attention_units
            + 2e-6 * f.chunk_keys
            + mixed * 0.002
        )

    def step(decode_ctx: list[int], chunk: tuple[int, int] | None = None) -> StepFeatures:
        f = StepFeatures()
        for ctx in decode_ctx:
            f.add_decode(ctx)
        if chunk is not None:
            f.add_chunk(*chunk)
        return f

    samples = [step([], (0, p)) for p in (8, 16, 32, 64, 128, 256, 512, 1024)]
    for ctx in (64, 1024):
        samples += [step([ctx] * d) for d in (1, 2, 4, 8, 16) if ctx == 64 or d in (1, 4)]
        samples += [step([ctx] * 4, (ctx, n)) for n in (1, 4, 12)]
    model = StepCostModel(refit_every=1, refit_interval_s=0)
    for f in samples * 2:
        model.observe(f, truth(f))
    for probe in (
        step([1000] * 4),
        step([600] * 4, (800, 6)),
        step([300] * 8),
        step([], (0, 700)),
    ):
        assert model.predict(probe) == pytest.approx(truth(probe), rel=0.03)
    # a decode-only step at 1,024 keys priced over one at 64: the attention is in the fit
    assert model.predict(step([1024] * 4)) - model.predict(step([64] * 4)) == pytest.approx(
        4 * 960 * (7e-7 + 2e-9), rel=0.1
    )


def test_an_itl_target_starts_from_a_calibrated_cost_model(tiny_qwen2_vl):
    """The profile run leaves a fitted model, an empty KV pool and no trace in the stats."""
    llm, eng = _engine(tiny_qwen2_vl, target_itl_ms="auto")
    model = eng.scheduler.cost_model
    assert model.ready and model.num_samples >= 10
    assert all(c >= 0 for c in model.coefficients().values())
    assert model.predict(StepFeatures(decode_tokens=4, attention_units=300)) > 0
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.get_stats().num_steps == 0
    # a fixed token budget and no target: no calibration, no start-up cost
    plain = _engine(tiny_qwen2_vl, max_num_batched_tokens=2048)[1]
    assert not plain.scheduler.cost_model.ready
    params = SamplingParams(temperature=0, max_tokens=8)
    assert llm.generate("a calibrated engine", params)[0].outputs[0].token_ids == plain_tokens(
        plain, "a calibrated engine", params
    )


def plain_tokens(eng, prompt: str, params: SamplingParams) -> list[int]:
    eng.add_request("plain", prompt, params)
    return _run_to_completion(eng)["plain"]


def test_an_unfitted_cost_term_is_never_treated_as_free(tiny_qwen2_vl):
    """If the fit zeroes the encoder (or prefill) term, the target must still bound the step."""
    _, eng = _engine(tiny_qwen2_vl, max_num_batched_tokens=2048, target_itl_ms="10")
    no_encoder = {**SYNTHETIC, "encoder_kunits": 0.0}
    eng.scheduler.cost_model = StepCostModel(coefficients=no_encoder)
    eng.add_request("chat", text_conv("hello"), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.add_request("cam", _frame_conv(91), SamplingParams(max_tokens=1), priority="batch")
    sched = eng.scheduler.schedule()
    tokens_per_unit = eng.scheduler.config.encoder_unit_tokens
    assert sched.encoder_work, "the frame's encoding got some of the step"
    for units in sched.encoder_work.values():
        # priced by FLOPs: the encoder work alone fits in what the target leaves
        assert 0 < units * tokens_per_unit * SYNTHETIC["prefill_tokens"] <= 0.010
    # and the step, priced with the real encoder rate, stays within the target's order
    priced = StepCostModel(coefficients=SYNTHETIC)
    assert priced.predict(sched.features) <= 2 * 0.010

    eng.scheduler.cost_model = StepCostModel(coefficients={**SYNTHETIC, "prefill_tokens": 0.0})
    eng.add_request(
        "long", text_conv("words " * 300), SamplingParams(max_tokens=1), priority="batch"
    )
    sched = eng.scheduler.schedule()
    assert sched.num_prefill_tokens <= 2 * eng.kv.block_size


def test_a_calibration_is_keyed_by_the_kernels_code(tiny_qwen2_vl, monkeypatch):
    """A cached calibration priced the kernels it ran: once their sources change (a faster
    GEMV) it is stale, whatever else stayed the same."""
    from engine import calibration
    from engine import kernels as cpu_kernels

    eng = LLM(str(tiny_qwen2_vl), dtype="bfloat16", max_num_batched_tokens=2048).engine
    if not eng.platform.use_cpu_kernels:
        pytest.skip("no CPU kernels here: nothing of theirs to key")
    key = calibration.calibration_key(eng)
    assert calibration.calibration_key(eng) == key
    monkeypatch.setattr(cpu_kernels, "sources_digest", lambda variant: "other sources")
    assert calibration.calibration_key(eng) != key

    def unreadable(variant: str) -> str:
        raise FileNotFoundError("cpu_decode.cpp")

    # an installation without the sources (prebuilt modules only) still starts
    monkeypatch.setattr(cpu_kernels, "sources_digest", unreadable)
    assert calibration.calibration_key(eng) not in (key, None)
