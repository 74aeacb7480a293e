"""Image encoding obeys the step budget: it is spread over steps that keep decoding chat."""

from __future__ import annotations

import math

import torch

from engine import LLM, SamplingParams
from engine.models.vision_encoder import VisionEncodeJob
from tests.engine.helpers import image_conv, noise_image, text_conv

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _frame():
    return image_conv("Who is in the frame?", noise_image(224, 224, seed=404))


def test_split_encoding_gives_the_same_tokens(tiny_checkpoint):
    whole = LLM(str(tiny_checkpoint), dtype="float32", enable_chunked_encoder=False)
    split = LLM(
        str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=8, encoder_rows_per_item=16
    )
    convs = [_frame(), text_conv("and a text question")]
    expected = [o.outputs[0].token_ids for o in whole.chat(convs, GREEDY)]
    assert [o.outputs[0].token_ids for o in split.chat(convs, GREEDY)] == expected


def test_decode_steps_carry_no_more_encoder_work_than_the_budget(tiny_qwen2_vl):
    budget = 24
    llm = LLM(
        str(tiny_qwen2_vl),
        dtype="float32",
        max_num_batched_tokens=budget,
        encoder_rows_per_item=8,
        enable_prefix_caching=False,
    )
    eng, sched_ = llm.engine, llm.engine.scheduler
    eng.add_request("chat", text_conv("hello"), SamplingParams(max_tokens=200, ignore_eos=True))
    while not sched_.requests["chat"].output_token_ids:
        eng.step()
    eng.add_request("cam", _frame(), GREEDY, priority="batch")
    tokens_per_unit = sched_.new_budget().tokens_per_encoder_unit()
    steps_with_encoder_work = 0
    while ("cam" in sched_.requests and sched_.requests["cam"].num_computed_tokens == 0) or (
        "cam" in sched_.requests and not sched_.requests["cam"].output_token_ids
    ):
        out = sched_.schedule()
        assert any(c.request_id == "chat" and c.is_decode for c in out.chunks), "chat never waits"
        assert all(math.isfinite(u) for u in out.encoder_work.values())
        encoder_tokens = 0
        for h, units in out.encoder_work.items():
            left = sched_.encoder_cache.encoding_left(h)  # None: job just started
            encoder_tokens += math.ceil(
                (units if left is None else min(units, left)) * tokens_per_unit
            )
        tokens = out.num_decode_tokens + out.num_prefill_tokens
        assert tokens + encoder_tokens <= budget
        if out.encoder_work:
            steps_with_encoder_work += 1
        result = eng.runner.execute(out)
        sched_.update_from_output(out, result.sampled, result.encoder_progress)
    assert steps_with_encoder_work > 1, "the frame's encoding was spread over several steps"


def test_encoder_work_beside_chat_decodes_runs_on_every_thread(tiny_qwen2_vl, monkeypatch):
    """Encoder pieces beside chat decodes once ran on one thread fewer, to leave the server's
    front end a core; with the step loop's OpenMP team the only one (engine/openmp.py) that
    cost more than it saved: on a 2-core AVX2 EPYC, 4 chat streams + 2 frames, two pairs of
    server runs, encoder us/unit beside chat 83/67 on every thread against 126/111 on one,
    and chat ITL p50 22.0/20.3 against 26.1/25.5 ms."""
    threads_before = torch.get_num_threads()
    try:
        llm = LLM(
            str(tiny_qwen2_vl),
            dtype="float32",
            device="cpu",
            max_num_batched_tokens=24,
            encoder_rows_per_item=8,
            num_threads=2,
        )
        eng = llm.engine
        step = {"interactive": False}
        seen: list[tuple[bool, int]] = []  # (interactive decodes in the step, threads)
        advance, execute = VisionEncodeJob.advance, eng.runner.execute

        def advance_watched(job, *args, **kwargs):
            seen.append((step["interactive"], torch.get_num_threads()))
            return advance(job, *args, **kwargs)

        def execute_watched(sched):
            step["interactive"] = sched.interactive_decodes
            return execute(sched)

        monkeypatch.setattr(VisionEncodeJob, "advance", advance_watched)
        monkeypatch.setattr(eng.runner, "execute", execute_watched)

        eng.add_request("alone", _frame(), GREEDY, priority="batch")
        while eng.has_unfinished():
            eng.step()
        eng.add_request("chat", text_conv("hello"), SamplingParams(max_tokens=200, ignore_eos=True))
        while not eng.scheduler.requests["chat"].output_token_ids:
            eng.step()
        frame = image_conv("Who is in the frame?", noise_image(224, 224, seed=405))
        eng.add_request("beside", frame, GREEDY, priority="batch")
        while "beside" in eng.scheduler.requests:
            eng.step()

        assert (False, 2) in seen, "a frame alone encodes on every thread"
        assert (True, 2) in seen, "and so does a frame beside chat decodes"
        assert all(threads == 2 for _, threads in seen), seen
    finally:
        torch.set_num_threads(threads_before)
