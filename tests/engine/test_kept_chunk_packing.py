"""The fused kernel keeps a prompt's packed keys and values from one chunk to the next.

A chunked prompt's fused steps used to repack (and on AVX2 widen) the whole context in every
layer of every step; the packing now stays in the kernel under a key the runner gives each
prompt mid-prefill (``FusedDecoder.forward``'s ``context_keys``). What must hold: the same
numbers as packing afresh, bit for bit, including when the slots under a key move; nothing
kept once a prompt's prefill ends, is aborted or preempted; a bounded number of prompts kept.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import load_cpu_decode
from tests.engine.helpers import text_conv

kernels = load_cpu_decode()
pytestmark = pytest.mark.skipif(
    kernels is None, reason="needs AVX-512 or AVX2 and a C++ compiler (the engine falls back)"
)

BLOCK = 4


def _llm(checkpoint, **kw) -> LLM:
    """The fused kernel's engine: bf16 on the CPU (also where a GPU would be picked)."""
    return LLM(model=str(checkpoint), dtype="bfloat16", device="cpu", block_size=BLOCK, **kw)


class _Recorder:
    """The runner's fused decoder, each forward's logits and the kept count after it recorded."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        self.logits: list[torch.Tensor] = []
        self.kept: list[int] = []

    def forward(self, *args, **kwargs):
        out = self.decoder.forward(*args, **kwargs)
        self.logits.append(out.clone())
        self.kept.append(self.decoder.kept_contexts())
        return out

    def __getattr__(self, name: str):
        return getattr(self.decoder, name)


def _prefill_logits(checkpoint, keep: bool) -> tuple[list[torch.Tensor], list[int], object]:
    llm = _llm(checkpoint, max_num_batched_tokens=12)
    runner = llm.engine.runner
    recorder = _Recorder(runner.fused_decoder)
    runner.fused_decoder = recorder
    if not keep:
        real = runner._context_keys
        runner._context_keys = lambda chunks: torch.zeros_like(real(chunks))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.chat([text_conv("describe the scene: " + "a red car parked by a tree, " * 12)], params)
    return recorder.logits, recorder.kept, recorder.decoder


def test_kept_packing_gives_the_same_logits_bit_for_bit(tiny_qwen2_vl) -> None:
    """A ~100-token prompt in 12-row fused steps: every step's logits equal those of packing
    the whole context afresh, and nothing stays kept once the prompt is prefilled."""
    kept_logits, kept_counts, decoder = _prefill_logits(tiny_qwen2_vl, keep=True)
    fresh_logits, fresh_counts, _ = _prefill_logits(tiny_qwen2_vl, keep=False)
    assert len(kept_logits) == len(fresh_logits) >= 8
    for a, b in zip(kept_logits, fresh_logits, strict=True):
        assert torch.equal(a, b)
    assert max(kept_counts) == 1 and max(fresh_counts) == 0  # the path under test ran
    assert decoder.kept_contexts() == 0  # let go when the last chunk ran


def _direct_inputs(runner, start: int, n: int, table: list[int], hidden: int):
    gen = torch.Generator().manual_seed(start)
    embeds = torch.randn(n, hidden, generator=gen).bfloat16()
    positions = torch.arange(start, start + n).expand(3, n)
    cos, sin = runner.model.rotary.cos_sin(positions, torch.bfloat16)
    tables = torch.tensor([table] * n, dtype=torch.long)
    lengths = torch.arange(start + 1, start + n + 1, dtype=torch.long)
    return embeds, cos, sin, tables, lengths, BLOCK


def test_a_key_whose_slots_moved_is_packed_again(tiny_qwen2_vl) -> None:
    """Under one key, a chunk whose earlier tokens now sit in other cache blocks (holding
    other values) attends to those values, not to the packing of the old blocks."""
    llm = _llm(tiny_qwen2_vl)
    runner = llm.engine.runner
    decoder = runner.fused_decoder
    hidden = runner.model.embed_tokens.embedding_dim
    first = list(range(0, 10))  # blocks of the first placement (40 tokens)
    moved = list(range(20, 30))
    key = torch.full((16,), 7, dtype=torch.long)

    decoder.forward(*_direct_inputs(runner, 0, 16, first, hidden), None, key)
    assert decoder.kept_contexts() == 1
    # same slots: the kept packing is reused and gives what packing afresh gives
    args = _direct_inputs(runner, 16, 16, first, hidden)
    fresh = decoder.forward(*args)
    assert torch.equal(decoder.forward(*args, None, key), fresh)
    # the first 16 tokens' values now come from other blocks with other values
    gen = torch.Generator().manual_seed(1)
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            for b in moved[:4]:
                cache[b * BLOCK : (b + 1) * BLOCK] = torch.randn(
                    BLOCK, *cache.shape[1:], generator=gen
                ).bfloat16()
    args = _direct_inputs(runner, 16, 16, moved, hidden)
    fresh = decoder.forward(*args)
    assert torch.equal(decoder.forward(*args, None, key), fresh)
    decoder.forget_context(7)
    assert decoder.kept_contexts() == 0


def test_at_most_a_handful_of_prompts_are_kept(tiny_qwen2_vl) -> None:
    llm = _llm(tiny_qwen2_vl)
    runner = llm.engine.runner
    hidden = runner.model.embed_tokens.embedding_dim
    for key in range(1, 8):
        table = list(range(10 * key, 10 * key + 10))
        keys = torch.full((16,), key, dtype=torch.long)
        runner.fused_decoder.forward(*_direct_inputs(runner, 0, 16, table, hidden), None, keys)
    assert runner.fused_decoder.kept_contexts() == 4


def _prefill_partly(llm: LLM, request_id: str) -> None:
    engine = llm.engine
    prompt = engine.process_inputs({"prompt_token_ids": list(range(100, 160))})
    engine.add_processed(request_id, prompt, SamplingParams(max_tokens=2, temperature=0))
    for _ in range(3):
        engine.step()


def test_an_abort_mid_prefill_lets_the_packing_go(tiny_qwen2_vl) -> None:
    llm = _llm(tiny_qwen2_vl, max_num_batched_tokens=12)
    _prefill_partly(llm, "r1")
    assert llm.engine.runner.fused_decoder.kept_contexts() == 1
    llm.engine.abort("r1")
    assert llm.engine.runner.fused_decoder.kept_contexts() == 0
    assert not llm.engine.runner._prompt_keys


def test_a_preempted_prompt_starts_under_a_new_key(tiny_qwen2_vl) -> None:
    """Recompute-style preemption drops the prompt's KV: its packing goes with it, and the
    recomputation is packed under a key of its own."""
    llm = _llm(tiny_qwen2_vl, max_num_batched_tokens=12)
    runner = llm.engine.runner
    keys_seen: list[set[int]] = []
    real_keys = runner._context_keys

    def recording_keys(chunks):
        keys = real_keys(chunks)
        keys_seen.append({int(k) for k in keys if k > 0})
        return keys

    runner._context_keys = recording_keys
    _prefill_partly(llm, "r1")
    before = set().union(*keys_seen)
    assert len(before) == 1  # one key for all of the prompt's chunks so far
    engine = llm.engine
    out = type("Out", (), {"preempted_ids": []})()
    engine.scheduler._preempt(engine.scheduler.running[0], out)
    runner.forget_requests(out.preempted_ids)
    assert runner.fused_decoder.kept_contexts() == 0
    keys_seen.clear()
    while engine.has_unfinished():
        engine.step()
    after = set().union(*keys_seen)
    assert len(after) == 1 and after.isdisjoint(before)
    assert not runner._prompt_keys and runner.fused_decoder.kept_contexts() == 0


def test_a_prompt_done_in_one_chunk_keeps_nothing_and_pushes_no_one_out(tiny_qwen2_vl) -> None:
    """A chat prompt prefilled in one step has no next chunk to keep packing for: it gets no
    key, so the prompts mid-prefill beside it (camera frames) keep theirs."""
    # 3 rows of each of the 4 frames a step
    llm = _llm(tiny_qwen2_vl, max_num_batched_tokens=12, long_prefill_token_threshold=3)
    runner, engine = llm.engine.runner, llm.engine
    for rid in ("f1", "f2", "f3", "f4"):
        engine.add_processed(
            rid,
            engine.process_inputs({"prompt_token_ids": list(range(100, 160))}),
            SamplingParams(max_tokens=2, temperature=0),
            priority="batch",
        )
    engine.step()
    assert len(runner._prompt_keys) == 4, "every frame has run a chunk"
    kept_keys = dict(runner._prompt_keys)
    assert runner.fused_decoder.kept_contexts() == 4
    engine.add_processed(
        "chat",
        engine.process_inputs({"prompt_token_ids": list(range(200, 203))}),
        SamplingParams(max_tokens=2, temperature=0),
    )
    engine.step()
    assert engine.scheduler.requests["chat"].output_token_ids, "prefilled in that one step"
    assert runner._prompt_keys == kept_keys, "no key for it; the frames' stay"
    assert runner.fused_decoder.kept_contexts() == 4
