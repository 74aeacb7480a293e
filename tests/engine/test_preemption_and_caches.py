"""Running out of KV blocks preempts (recompute) without changing outputs; identical images are
encoded once."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.scheduler import SchedulerOutput
from tests.engine.helpers import image_conv, noise_image, text_conv

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _convs():
    return [text_conv(f"request number {i}: describe the scene " * (1 + i % 3)) for i in range(6)]


def test_small_kv_pool_preempts_and_outputs_are_unchanged(tiny_checkpoint):
    roomy = LLM(str(tiny_checkpoint), dtype="float32", block_size=4)
    reference = [o.outputs[0].token_ids for o in roomy.chat(_convs(), GREEDY)]

    # each request needs ~12-22 blocks of 4 by the end; 40 blocks cannot hold all six
    tight = LLM(str(tiny_checkpoint), dtype="float32", block_size=4, num_kv_blocks=40)
    outs = tight.chat(_convs(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = tight.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0, "finished requests must return every block"


def test_same_image_twice_is_encoded_once(tiny_checkpoint):
    frame = noise_image(112, 112, seed=21)
    # prefix caching off: otherwise the repeated prompt never reaches the encoder at all
    llm = LLM(str(tiny_checkpoint), dtype="float32", enable_prefix_caching=False)
    alone = llm.chat(image_conv("What do you see?", frame), GREEDY)[0].outputs[0].token_ids
    before = llm.engine.get_stats()
    # same pixels, new PIL object, in a batch with a different question
    convs = [image_conv("What do you see?", frame.copy()), image_conv("Anyone there?", frame)]
    outs = llm.chat(convs, GREEDY)
    after = llm.engine.get_stats()
    assert after.encoder_cache_misses == before.encoder_cache_misses
    assert after.encoder_cache_hits - before.encoder_cache_hits == 2
    assert outs[0].outputs[0].token_ids == alone


def test_abort_frees_everything_at_once(tiny_qwen2_vl):
    llm = LLM(str(tiny_qwen2_vl), dtype="float32")
    eng = llm.engine
    eng.add_request("a", text_conv("keep talking"), SamplingParams(max_tokens=100, ignore_eos=True))
    eng.add_request("b", text_conv("me too"), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(5):
        eng.step()
    assert eng.get_stats().kv_blocks_used > 0
    out = eng.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    eng.abort("b")
    stats = eng.get_stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_aborted == 2
    assert not eng.has_unfinished()


def test_an_abort_mid_encoding_frees_the_half_done_job(tiny_qwen2_vl):
    """A camera frame aborted while its image encodes leaves nothing behind: the tower's
    per-patch state (tens of times the finished embeddings) is freed at once, not when the
    encoder cache's token count would push the entry out; the same frame sent again is encoded
    afresh and answers as if the first had never been sent."""
    llm = LLM(
        str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=24, encoder_rows_per_item=8
    )
    eng = llm.engine
    frame = image_conv("Who is in the frame?", noise_image(224, 224, seed=77))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("first", frame, params, priority="batch")
    while not eng.runner.encode_jobs:
        eng.step()
    (h,) = eng.runner.encode_jobs
    eng.step()
    assert not eng.runner.encode_jobs[h].done(), "aborted mid-encoding"
    assert eng.abort("first").outputs[0].finish_reason == "abort"
    assert not eng.runner.encode_jobs and h not in eng.runner.encoder_outputs
    assert not eng.scheduler.encoder_cache.contains(h)
    assert eng.scheduler.encoder_cache.used == 0
    assert eng.get_stats().kv_blocks_used == 0

    again = llm.chat([frame], params)[0].outputs[0].token_ids
    assert (
        again
        == LLM(str(tiny_qwen2_vl), dtype="float32").chat([frame], params)[0].outputs[0].token_ids
    )


def test_a_preempted_request_keeps_its_half_done_encoding(tiny_qwen2_vl):
    """Preemption requeues the request first: the encoding it will want again stays."""
    llm = LLM(
        str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=24, encoder_rows_per_item=8
    )
    eng = llm.engine
    frame = image_conv("Who is in the frame?", noise_image(224, 224, seed=78))
    eng.add_request("cam", frame, SamplingParams(max_tokens=4), priority="batch")
    while not eng.runner.encode_jobs:
        eng.step()
    (h,) = eng.runner.encode_jobs
    req = eng.scheduler.requests["cam"]
    assert req in eng.scheduler.running
    eng.scheduler._preempt(req, SchedulerOutput())
    assert eng.scheduler.encoder_cache.contains(h) and h in eng.runner.encode_jobs
    eng.step()
    assert h in eng.runner.encode_jobs or h in eng.runner.encoder_outputs
