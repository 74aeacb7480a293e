"""Chunked prefill is exact: any budget, with chunk boundaries inside image placeholders."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.attention import build_attention_metadata, paged_attention
from tests.engine.helpers import image_conv, noise_image, text_conv

CONVERSATIONS = [
    image_conv("Who is standing at the door?", noise_image(112, 140, seed=5)),
    text_conv("Summarise what the street camera saw this morning, in detail."),
    image_conv("Two views:", noise_image(84, 112, seed=6), noise_image(112, 84, seed=7)),
]


def _run(checkpoint, **engine_args):
    llm = LLM(str(checkpoint), dtype="float32", **engine_args)
    outs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=16))
    return [o.outputs[0].token_ids for o in outs], llm


def test_chunked_budgets_match_unchunked(tiny_checkpoint):
    reference, llm = _run(
        tiny_checkpoint, enable_chunked_prefill=False, max_num_batched_tokens=8192
    )
    # the image's placeholders start mid-prompt: budget 8 must cut through them
    first_image = llm.engine.process_inputs({"messages": CONVERSATIONS[0]}).images[0]
    assert first_image.offset % 8 != 0 or first_image.num_tokens > 8
    for budget in (8, 16, 64):
        tokens, chunked = _run(tiny_checkpoint, max_num_batched_tokens=budget)
        assert tokens == reference, f"budget {budget}"
        assert chunked.engine.stats.num_steps > llm.engine.stats.num_steps
    tokens, _ = _run(tiny_checkpoint)  # the default: steps sized by predicted time
    assert tokens == reference, "time-sized steps"


def test_chunks_respect_the_budget_and_decodes_come_first(tiny_qwen2_vl):
    llm = LLM(str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=16)
    eng = llm.engine
    eng.add_request("chat", text_conv("hello there"), SamplingParams(temperature=0, max_tokens=30))
    while not eng.scheduler.requests["chat"].output_token_ids:
        eng.step()
    conv = image_conv("describe", noise_image(140, 140, seed=9))
    eng.add_request("frame", conv, SamplingParams(temperature=0, max_tokens=2))
    seen_prefill_with_decode = False
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        assert sched.num_decode_tokens + sched.num_prefill_tokens <= 16
        kinds = [c.is_decode for c in sched.chunks]
        assert kinds == sorted(kinds, reverse=True), "decodes must precede prefill chunks"
        if any(kinds) and not all(kinds):
            seen_prefill_with_decode = True
        result = eng.runner.execute(sched)
        eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)
    assert seen_prefill_with_decode


def test_a_prompts_last_token_left_alone_by_a_chunk_is_prefill_not_decode(tiny_qwen2_vl):
    """A budget one short of the prompt leaves its last token for a one-token chunk: that is
    still prompt work (counted, traced and run as a prefill; the decode path embeds ids only,
    so an image token there would lose its embedding), and the output is unchanged."""
    conv = text_conv("Who is at the gate this morning?")  # text: no wait for an encoder
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reference = LLM(str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=4096)
    expected = reference.chat([conv], params)[0].outputs[0].token_ids
    prompt_len = len(reference.engine.process_inputs({"messages": conv}).token_ids)

    llm = LLM(str(tiny_qwen2_vl), dtype="float32", max_num_batched_tokens=prompt_len - 1)
    eng = llm.engine
    eng.add_request("gate", conv, params)
    request = eng.scheduler.requests["gate"]
    kinds = []
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        kinds.append([(c.num_tokens, c.is_decode) for c in sched.chunks])
        result = eng.runner.execute(sched)
        eng.scheduler.update_from_output(sched, result.sampled, result.encoder_progress)
    assert kinds[:2] == [[(prompt_len - 1, False)], [(1, False)]]
    assert all(step == [(1, True)] for step in kinds[2:]) and len(kinds) == 2 + 3
    assert request.output_token_ids == expected


@pytest.mark.parametrize("kernel", ["lse-merge", "masked"])
@pytest.mark.parametrize("num_kv_heads,num_heads", [(2, 4), (4, 4)])
def test_paged_attention_chunks_equal_one_causal_pass(num_kv_heads, num_heads, kernel, monkeypatch):
    """1,000 tokens in chunks 256+256+256+232, each attending to cached K/V plus itself —
    through the CPU log-sum-exp merge and through the portable masked path."""
    if kernel == "masked":
        monkeypatch.setattr("engine.layers.attention._FLASH_CPU", None)
    torch.manual_seed(0)
    n, d, block = 1000, 32, 16
    q = torch.randn(n, num_heads, d)
    k = torch.randn(n, num_kv_heads, d)
    v = torch.randn(n, num_kv_heads, d)
    num_blocks = 80
    # a shuffled block table: physical blocks are not contiguous
    table = torch.randperm(num_blocks)[: -(-n // block)].tolist()
    k_cache = torch.zeros(num_blocks * block, num_kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    scale = d**-0.5

    chunked = []
    for start in range(0, n, 256):
        end = min(n, start + 256)
        meta = build_attention_metadata([table], [start], [end - start], block, torch.device("cpu"))
        chunked.append(
            paged_attention(q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, scale)
        )
    chunked_out = torch.cat(chunked)

    group = num_heads // num_kv_heads
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk, vv, is_causal=True, scale=scale
    ).transpose(0, 1)
    assert [len(c) for c in chunked] == [256, 256, 256, 232]
    torch.testing.assert_close(chunked_out, ref, atol=1e-5, rtol=1e-5)


def test_decode_rows_match_full_attention():
    torch.manual_seed(1)
    heads, kv_heads, d, block = 4, 2, 16, 4
    lengths = [5, 9, 1 + 16]
    k_cache = torch.zeros(64 * block, kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    tables = [[3, 7], [10, 2, 8], [20, 21, 22, 23, 24]]
    qs, ks, vs = [], [], []
    for table, n in zip(tables, lengths, strict=True):
        q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
        meta = build_attention_metadata([table], [0], [n - 1], block, torch.device("cpu"))
        paged_attention(q[:-1], k[:-1], v[:-1], k_cache, v_cache, meta, d**-0.5)
        qs.append(q), ks.append(k), vs.append(v)
    meta = build_attention_metadata(
        tables, [n - 1 for n in lengths], [1, 1, 1], block, torch.device("cpu")
    )
    assert meta.num_decodes == 3
    out = paged_attention(
        torch.stack([q[-1] for q in qs]),
        torch.stack([k[-1] for k in ks]),
        torch.stack([v[-1] for v in vs]),
        k_cache,
        v_cache,
        meta,
        d**-0.5,
    )
    for i, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        kk = k.repeat_interleave(2, dim=1).transpose(0, 1)
        vv = v.repeat_interleave(2, dim=1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[-1:].transpose(0, 1), kk, vv, scale=d**-0.5
        ).transpose(0, 1)[0]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
