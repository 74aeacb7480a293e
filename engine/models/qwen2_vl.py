"""Qwen2-VL / Qwen2.5-VL: our language decoder over a flat paged batch, the family's vision tower.

The decoder is written here (it runs every step and must read the paged KV cache); the vision
tower is the ``transformers`` module of the family (it runs once per image). Weights load by
tensor name from safetensors, accepting both the original hub layout (``model.layers.*``,
``visual.*``) and the layout newer ``transformers`` releases write (``model.language_model.*``,
``model.visual.*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, paged_attention
from engine.layers.linear import UpcastLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import MRotaryEmbedding, apply_rotary
from engine.models.vision_encoder import VisionTower


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # q, k and v in one matmul: one weight read and one kernel launch instead of three
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.scale = head_dim**-0.5
        self.kernels = None  # engine.kernels module: native attention (bf16 CPU)
        self.native_prefill = True  # long prompt chunks through it too (the platform plan's)
        self.amx = False  # its products on AMX tiles (the platform plan's)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = paged_attention(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
            self.kernels,
            self.native_prefill,
            self.amx,
        )
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, safe_point: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """``safe_point`` runs between the two products (see DecoderLayer.forward)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        upcast = isinstance(gate_up, UpcastLinear) and isinstance(down, UpcastLinear)
        if upcast and gate_up.widens(x):  # bf16 without bf16 arithmetic: fp32 between products
            gate, up = gate_up.forward_fp32(x).chunk(2, dim=-1)
            act = F.silu(gate, inplace=True).mul_(up)
            if safe_point is not None:
                safe_point()
            return down.forward_fp32(act).to(x.dtype)
        gate, up = gate_up(x).chunk(2, dim=-1)
        act = F.silu(gate) * up
        if safe_point is not None:
            safe_point()
        return down(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, head_dim: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        # the largest share of the layer's weights between two of its safe points (the
        # attention's projections, the MLP's gate/up product, its down product), from the
        # shapes: loading may swap the linears for packed or int8 ones. The attention's own
        # work over the keys is not counted: for bench it is 55 % of the first part at a
        # frame's 1,250 keys (that part then ~0.42 of the layer), ~1.2 bounds at 4,000 keys
        attn = self.self_attn.q_size * cfg.hidden_size * 2
        attn += 2 * self.self_attn.kv_size * cfg.hidden_size
        gate_up, down = (
            2 * cfg.hidden_size * cfg.intermediate_size,
            cfg.hidden_size * cfg.intermediate_size,
        )
        self.longest_part_share = max(attn, gate_up, down) / (attn + gate_up + down)

    def forward(self, x, cos, sin, kv_cache, meta, safe_point: Callable[[], None] | None = None):
        """``safe_point`` (an interruptible step's, see Qwen2VLModel.forward) is called after
        the attention and between the MLP's two products: a chat arriving during a long camera
        step waits for one of three parts, not a whole layer. For a 1,200-token chunk (bench,
        bf16, 2-core AMX Xeon) a layer took ~60 ms, the attention ~45 % of it; the MLP's
        gate/up product holds two thirds of its weights. Pieces of the MLP by rows would cut
        the wait further but cost the step: ~15 % in 256-row pieces, 1-5 % in 512-row ones
        there (one noisy series of runs), so each product stays whole."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        if safe_point is not None:
            safe_point()
        return x + self.mlp(self.post_attention_layernorm(x), safe_point)


def build_vision_tower(hf_config, architecture: str) -> nn.Module:
    """The family's ``transformers`` vision tower: it runs once per image; reuse beats rewrite."""
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Tower,
        )
    return Tower._from_config(hf_config.vision_config)


class Qwen2VLModel(nn.Module):
    """Text decoder + vision tower of one Qwen2-VL-family checkpoint."""

    def __init__(self, hf_config, architecture: str, with_vision: bool = True) -> None:
        super().__init__()
        text = hf_config.text_config
        self.text_config = text
        self.vision_config = hf_config.vision_config
        self.head_dim = (
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        )
        self.num_kv_heads = text.num_key_value_heads
        self.num_layers = text.num_hidden_layers
        self.image_token_id = hf_config.image_token_id
        self.tie_word_embeddings = bool(
            getattr(hf_config, "tie_word_embeddings", False)
            or getattr(text, "tie_word_embeddings", False)
        )
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
        section = rope.get("mrope_section") or [self.head_dim // 2, 0, 0]
        self.rotary = MRotaryEmbedding(self.head_dim, theta, list(section))

        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(text, self.head_dim) for _ in range(text.num_hidden_layers)]
        )
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.visual = build_vision_tower(hf_config, architecture) if with_vision else None
        self.spatial_merge_size = self.vision_config.spatial_merge_size
        self.architecture = architecture
        # "engine": our VisionTower forward over self.visual's weights (resumable, fused
        # attention); "hf": the transformers module's own forward, kept for parity tests
        self.vision_impl = "engine"
        self._vision_tower: VisionTower | None = None
        # the decoder weights for the fused CPU decode kernel (engine.kernels), copied to huge
        # pages (only the norms and biases where the plan lets the row-major matrices go once
        # the kernel holds its panels: then None after that); with int8 weights the int8
        # tensors themselves (the kernel packs them into its own huge-page panels); None where
        # that kernel is off or cannot run
        self.decode_kernel_weights_hp: list[torch.Tensor] | None = None
        # int8 weights (--quantization int8): their per-output-channel scales in the kernel's
        # order (int8_decode_weights); None for 16-bit weights
        self.decode_kernel_scales: list[torch.Tensor] | None = None
        self.cpu_kernels = None  # engine.kernels module where the native kernels run
        # prompt chunks and the vision tower attend through torch's flash kernel, not ours
        # (engine/platform.py decides; load_model sets it before the kernels)
        self.torch_flash_attention = False
        # engine.kernels' attention with its products on AMX tiles (the platform plan's)
        self.amx_attention = False

    # ---- forward pieces -------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        safe_point: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """hidden: [T, hidden] input embeddings; positions: [3, T]. Returns final-norm states.

        ``safe_point`` runs after each layer's attention, between its MLP's products and after
        each layer but the last: an interruptible step's safe points
        (engine/step_interrupt.py), which raise to give the step up."""
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv_cache, meta, safe_point)
            if safe_point is not None and i < last:
                safe_point()
        return self.norm(hidden)

    def set_cpu_kernels(self, kernels) -> None:
        """Route bf16 CPU attention through the native kernels: decodes always, prompt chunks
        and the vision tower unless ``torch_flash_attention`` (set first, from the platform
        plan: AMX CPUs without our kernel's tiles, where torch's flash kernel is faster)."""
        self.cpu_kernels = kernels
        for layer in self.layers:
            layer.self_attn.kernels = kernels
            layer.self_attn.native_prefill = not self.torch_flash_attention
            layer.self_attn.amx = self.amx_attention
        self._vision_tower = None  # rebuilt with the kernels on next use

    def decode_kernel_weights(self) -> list[torch.Tensor]:
        """Plain decoder weights in the fused decode kernel's order: per layer input norm,
        qkv weight and bias, o_proj, post-attention norm, gate_up, down; then the final norm
        and lm_head. Taken before the linears are packed for oneDNN (packing drops them)."""
        return [p.detach() for p in self.decode_kernel_params()]

    def decode_kernel_params(self) -> list[nn.Parameter]:
        """The parameters behind :meth:`decode_kernel_weights`, in the same order."""
        out: list[nn.Parameter] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [
                layer.input_layernorm.weight,
                attn.qkv_proj.weight,
                attn.qkv_proj.bias,
                attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                mlp.gate_up_proj.weight,
                mlp.down_proj.weight,
            ]
        return [*out, self.norm.weight, self.lm_head.weight]

    def int8_decode_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """After ``quantize_linears``: the fused decode kernel's tensors in the order of
        :meth:`decode_kernel_weights`, the linears as their int8 weights (shared with the
        eager Int8Linears, not copied: the kernel packs its own panels from them), and the
        scales per layer [qkv, o, gate_up, down], then the lm_head's. The qkv bias goes back
        to the model's dtype, which it came from (Int8Linear keeps it in fp32)."""
        from engine.layers.quantized import Int8Linear

        dtype = self.norm.weight.dtype
        weights: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            lins = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            if not all(isinstance(m, Int8Linear) for m in [*lins, self.lm_head]):
                raise TypeError("int8_decode_weights: the decoder linears are not all int8")
            weights += [
                layer.input_layernorm.weight.detach(),
                attn.qkv_proj.qweight,
                attn.qkv_proj.bias.to(dtype),
                attn.o_proj.qweight,
                layer.post_attention_layernorm.weight.detach(),
                mlp.gate_up_proj.qweight,
                mlp.down_proj.qweight,
            ]
            scales += [m.scales for m in lins]
        weights += [self.norm.weight.detach(), self.lm_head.qweight]
        return weights, [*scales, self.lm_head.scales]

    def packed_decoder_weights(self) -> list[torch.Tensor] | None:
        """oneDNN-packed qkv, o, gate_up, down per layer, then lm_head; None if not packed."""
        from engine.layers.linear import PackedLinear

        mods = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            mods += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        mods.append(self.lm_head)
        if not all(isinstance(m, PackedLinear) for m in mods):
            return None
        return [m.packed for m in mods]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def vision_tower(self, max_rows_per_item: int | None = None) -> VisionTower:
        """Our resumable forward over ``self.visual``'s weights (built on first use)."""
        if self._vision_tower is None or self._vision_tower.max_rows_per_item != max_rows_per_item:
            self._vision_tower = VisionTower(
                self.visual,
                self.vision_config,
                self.architecture,
                max_rows_per_item,
                kernels=self.cpu_kernels,
                torch_flash=self.torch_flash_attention,
                amx_attention=self.amx_attention,
            )
        return self._vision_tower

    def encoder_unit_tokens(self) -> float:
        """FLOP ratio of one vision patch-block unit to one decoder token: the scheduler's
        exchange rate between encoder work and its token budget before it has measured both."""
        text = self.text_config
        hidden, inter = text.hidden_size, text.intermediate_size
        q = text.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
        token_flops = 2 * (self.num_layers * per_layer + hidden * text.vocab_size)
        return self.vision_tower().patch_block_flops / token_flops

    @torch.inference_mode()
    def encode_images(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> list[torch.Tensor]:
        """Vision tower over several images at once; one embedding tensor per image."""
        if self.vision_impl == "engine":
            return self.vision_tower().encode(pixel_values, grid_thw)
        weight = next(self.visual.parameters())
        # the transformers tower derives its rotary positions from grid_thw on grid_thw's device
        out = self.visual(
            pixel_values.to(weight.device, weight.dtype), grid_thw=grid_thw.to(weight.device)
        )
        merged = out.pooler_output if hasattr(out, "pooler_output") else out
        sizes = (grid_thw.prod(-1) // self.spatial_merge_size**2).tolist()
        return list(torch.split(merged, sizes))

    # ---- weights --------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name, fusing q/k/v and gate/up; fail if any is missing."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        fused: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            name = _canonical_name(name)
            if name is None:
                continue
            target, shard = _fused_target(name)
            if target is not None:
                fused.setdefault(target, {})[shard] = tensor
                continue
            if name in params:
                _copy(params[name], tensor, name)
                loaded.add(name)
            elif name in buffers:
                buffers[name].copy_(tensor)
            elif "rotary_emb.inv_freq" in name:
                continue
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        for target, shards in fused.items():
            if target.endswith("qkv_proj.weight") or target.endswith("qkv_proj.bias"):
                order = ("q", "k", "v")
            else:
                order = ("gate", "up")
            missing = [s for s in order if s not in shards]
            if missing:
                raise ValueError(f"checkpoint lacks {missing} for {target}")
            _copy(params[target], torch.cat([shards[s] for s in order], 0), target)
            loaded.add(target)
        if self.tie_word_embeddings or "lm_head.weight" not in loaded:
            if "lm_head.weight" not in loaded and not self.tie_word_embeddings:
                raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _canonical_name(name: str) -> str | None:
    """Map either checkpoint layout onto this module's parameter names."""
    for prefix, repl in (
        ("model.language_model.", ""),
        ("model.visual.", "visual."),
        ("language_model.model.", ""),
        ("language_model.lm_head.", "lm_head."),
        ("model.", ""),
    ):
        if name.startswith(prefix):
            return repl + name[len(prefix) :]
    if name.startswith(("visual.", "lm_head.")):
        return name
    return None


def _fused_target(name: str) -> tuple[str | None, str]:
    if name.startswith("visual."):
        return None, ""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in _FUSED:
            fused, shard = _FUSED[p]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return None, ""


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
