"""The paths every CPU runs, kernels or not: eager bf16 (UpcastLinear, bf16 KV cache), the
fallback when the kernels are off. (That every kernel variant compiles on any machine is
checked by ``scripts/test.sh``: ``python -m engine.kernels --compile-check``.)

These used to sit under the kernel module's skip, so a CPU without AVX-512 (where they are the
only paths) ran none of them.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.helpers import image_conv, noise_image, step_logits, text_conv

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_disabled_kernel_falls_back(tiny_qwen2_vl) -> None:
    llm = LLM(model=str(tiny_qwen2_vl), dtype="bfloat16", cpu_kernels=False)
    assert llm.engine.runner.fused_decoder is None
    out = llm.chat(text_conv("hi"), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.runner.fused_decode_steps == 0


def test_fp32_never_uses_the_kernel(tiny_qwen2_vl) -> None:
    llm = LLM(model=str(tiny_qwen2_vl), dtype="float32")
    assert llm.engine.runner.fused_decoder is None


@pytest.mark.parametrize(
    "conv",
    [
        text_conv("The station entrance at night"),
        image_conv("Who is here?", noise_image(112, 84, 5)),
    ],
    ids=["text", "image"],
)
def test_eager_bf16_logits_track_fp32(tiny_checkpoint, conv) -> None:
    """bf16 weights and KV cache on the eager path (no kernels): each step's logits stay close
    to the fp32 model's fed the same tokens, and the greedy tokens agree wherever fp32 is
    confident (a near-tie may flip under bf16 rounding)."""
    fp32 = LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=256)
    bf16 = LLM(
        str(tiny_checkpoint), dtype="bfloat16", cpu_kernels=False, max_num_batched_tokens=256
    )
    assert bf16.engine.runner.fused_decoder is None
    want = fp32.chat(conv, GREEDY)[0].outputs[0].token_ids
    got_logits = step_logits(bf16, conv, GREEDY)
    ref_logits = step_logits(fp32, conv, GREEDY)
    assert len(got_logits) == len(ref_logits) == len(want)
    got = bf16.chat(conv, GREEDY)[0].outputs[0].token_ids
    for step, (g, r) in enumerate(zip(got_logits, ref_logits, strict=True)):
        if got[:step] != want[:step]:
            break  # the sequences diverged at a near-tie: later logits see other tokens
        rel = ((g - r).norm() / r.norm()).item()
        assert rel < 0.03, f"step {step}: relative logit error {rel:.4f}"
        top2 = r.topk(2, dim=-1).values[0]
        if (top2[0] - top2[1]).item() > 2 * (g - r).abs().max().item():
            assert got[step] == want[step], f"step {step}: a token outside bf16's error changed"
