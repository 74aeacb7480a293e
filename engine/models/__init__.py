"""Model registry and loading: architecture name in ``config.json`` -> our implementation."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import UnsupportedModelError
from engine.kernels import load_cpu_decode
from engine.layers.linear import pack_linears
from engine.layers.quantized import quantize_linears
from engine.models.vision_encoder import TYPICAL_ITEM_ROWS
from engine.platform import PlatformPlan, plan_platform, vision_compute_dtype

__all__ = ["load_model", "read_architecture", "vision_compute_dtype"]

log = logging.getLogger("engine.models")

SUPPORTED_ARCHITECTURES = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)


def read_architecture(model_dir: Path) -> str:
    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json: is it a Hugging Face checkpoint?")
    archs = json.loads(config_path.read_text()).get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"architecture {archs or '(none)'} in {config_path} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    pack_cpu_weights: bool = True,
    cpu_kernels: bool = True,
    quantization: str | None = None,
    plan: PlatformPlan | None = None,
):
    """Build the model for ``model_dir``'s architecture and load its weights by tensor name.

    How the weights are kept (kernels, packing, quantization, the tower's dtype) follows the
    platform ``plan``; without one it is planned here from the other arguments."""
    if plan is None:
        plan = plan_platform(
            device,
            dtype,
            cpu_kernels=cpu_kernels,
            quantization=quantization,
            pack_cpu_weights=pack_cpu_weights,
        )
    from transformers import AutoConfig

    from engine.models.qwen2_vl import Qwen2VLModel, build_vision_tower

    model_dir = Path(model_dir)
    arch = read_architecture(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    t0 = time.perf_counter()
    # the decoder is built on the meta device (no wasted random init of big matrices) and
    # materialised empty; the small vision tower is built for real so its buffers are valid
    with torch.device("meta"):
        model = Qwen2VLModel(hf_config, arch, with_vision=False)
    model = model.to_empty(device=device).to(dtype)
    visual = build_vision_tower(hf_config, arch).to(device=device)
    vision_dtype = plan.vision_dtype
    for param in visual.parameters():  # parameters only: rotary inv_freq buffers stay fp32
        param.data = param.data.to(vision_dtype)
    model.visual = visual
    model.torch_flash_attention = plan.torch_flash_attention
    model.amx_attention = plan.amx_attention
    model.load_weights(iter_safetensors(model_dir))
    model.eval()
    kernels = load_cpu_decode() if plan.use_cpu_kernels else None
    if kernels is not None:
        if plan.quantization is None:  # before packing: the kernel reads plain row-major weights
            params = model.decode_kernel_params()
            # the eager path reads the same copy: one set of weights in memory, not two
            # (the emulated build's fused decoder adds its GEMV panels, about as much again).
            # Where the fused decoder lets its row-major matrices go (plan.gemv_row_major),
            # only the small tensors move: the huge pages are one arena, freed with the last
            # tensor in it, and the eager path keeps the norms
            moved = [p for p in params if plan.gemv_row_major or p.dim() < 2]
            hp = kernels.copy_to_huge_pages([p.detach() for p in moved])
            for param, copy in zip(moved, hp, strict=True):
                param.data = copy
            model.decode_kernel_weights_hp = [p.detach() for p in params]
        model.set_cpu_kernels(kernels)
        log.info(
            "native CPU kernels on (decoder %s on huge pages)",
            "weights" if plan.gemv_row_major or plan.quantization else "norms and biases",
        )
    if plan.cpu_linears and (model.cpu_kernels is not None or plan.emulated_bf16):
        # the vision tower's linears run once per ~64-row work item: F.linear would re-lay-out
        # (or, emulated, run at a fifth of the fp32 rate) each bf16 weight every time, and a
        # weight packed for one row (fp32 stays row-major then) is re-blocked inside every call
        replaced = pack_linears(visual, upcast_bf16=plan.emulated_bf16, rows_hint=TYPICAL_ITEM_ROWS)
        log.info("replaced %d vision linears for the CPU", replaced)
    if plan.quantization == "int8":
        # the head too: on small models it is a quarter of the weight bytes a step reads
        bf16_products = plan.bf16_arithmetic and plan.dtype == torch.bfloat16
        replaced = quantize_linears(model, skip_prefixes=("visual",), bf16_products=bf16_products)
        log.info("replaced %d decoder linears (weight-only int8)", replaced)
        if kernels is not None:  # the fused decode step reads the same int8 weights
            model.decode_kernel_weights_hp, model.decode_kernel_scales = model.int8_decode_weights()
    elif plan.cpu_linears:
        if model.tie_word_embeddings and not plan.emulated_bf16:
            # the packed head must not alias the embedding table
            model.lm_head.weight = torch.nn.Parameter(model.embed_tokens.weight.detach().clone())
        replaced = pack_linears(model, skip_prefixes=("visual",), upcast_bf16=plan.emulated_bf16)
        log.info("replaced %d decoder linears (%s)", replaced, plan.linear_kind)
    log.info(
        "model_loaded arch=%s dtype=%s device=%s params=%.1fM secs=%.2f",
        arch,
        dtype,
        device,
        sum(p.numel() for p in model.parameters()) / 1e6,
        time.perf_counter() - t0,
    )
    return model, hf_config, arch
