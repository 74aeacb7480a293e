"""Machine-dependent defaults: which dtype ``auto`` picks and how finely image encoding is split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.device
from engine.device import resolve_dtype
from engine.platform import encoder_rows_per_item, plan_platform

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("fast_bf16", "kernels_built", "want"),
    [(True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32)],
)
def test_auto_dtype_is_bf16_where_the_cpu_runs_it_fast_or_the_kernels_build(
    monkeypatch, fast_bf16: bool, kernels_built: bool, want: torch.dtype
) -> None:
    import engine.kernels

    monkeypatch.setattr(engine.device, "cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(
        engine.kernels, "load_cpu_decode", lambda: object() if kernels_built else None
    )
    assert resolve_dtype("auto", CPU) == want
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", CPU) == torch.float32


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo")
def test_cpu_probes_agree_with_the_kernels_flags(monkeypatch) -> None:
    """torch's probes against /proc/cpuinfo: a probe that lies (or a torch that renames it)
    would silently move every plan choice made from it (dtype, kernels, attention)."""
    import engine.kernels

    monkeypatch.delenv(engine.kernels.VARIANT_ENV, raising=False)
    flags = set(engine.device.cpuinfo_field("flags").split())  # the kernel's own word
    assert engine.device.cpu_has_amx() == ({"amx_tile", "amx_bf16"} <= flags)
    assert engine.device.cpu_has_fast_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)


def test_auto_dtype_without_bf16_arithmetic_or_kernels_is_fp32(monkeypatch) -> None:
    monkeypatch.setattr(engine.device, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", CPU, cpu_kernels=False) == torch.float32


def test_kernel_variant_follows_the_instruction_set(monkeypatch) -> None:
    """One module per variant: AVX-512 with or without its bf16 dot product (without it, with
    or without VNNI's integer one), else AVX2; the compile check covers the others.
    VISION_SERVE_CPU_VARIANT picks a lesser one the CPU runs, and is ignored otherwise."""
    import engine.kernels as kernels

    cases = [  # (avx512, bf16, vnni, avx2): the native build needs AVX512-BF16 and VNNI
        ((True, True, True, True), "native-bf16"),
        ((True, True, False, True), "emulated-bf16"),
        ((True, False, True, True), "emulated-bf16-vnni"),
        ((True, False, False, True), "emulated-bf16"),
        ((False, False, False, True), "avx2"),
        ((False, False, False, False), None),
    ]
    monkeypatch.delenv(kernels.VARIANT_ENV, raising=False)
    for (avx512, bf16, vnni, avx2), want in cases:
        monkeypatch.setattr(kernels, "cpu_supports_avx512", lambda v=avx512: v)
        monkeypatch.setattr(kernels, "cpu_supports_avx512_bf16", lambda v=bf16: v)
        monkeypatch.setattr(kernels, "cpu_supports_avx512_vnni", lambda v=vnni: v)
        monkeypatch.setattr(kernels, "cpu_supports_avx2", lambda v=avx2: v)
        assert kernels.cpu_variant() == want
        assert set(kernels.variants_not_loaded()) == set(kernels.VARIANTS) - {want}
    for name, value in [
        ("avx512", True),
        ("avx512_bf16", False),
        ("avx512_vnni", True),
        ("avx2", True),
    ]:
        monkeypatch.setattr(kernels, f"cpu_supports_{name}", lambda v=value: v)
    assert kernels.runnable_variants() == ["emulated-bf16-vnni", "emulated-bf16", "avx2"]
    monkeypatch.setenv(kernels.VARIANT_ENV, "avx2")
    assert kernels.cpu_variant() == "avx2"
    monkeypatch.setenv(kernels.VARIANT_ENV, "native-bf16")  # not on this CPU: its best
    assert kernels.cpu_variant() == "emulated-bf16-vnni"


@pytest.mark.parametrize("lesser", ["avx2", "emulated-bf16", "emulated-bf16-vnni"])
def test_a_lesser_variant_plans_as_its_cpu_class(monkeypatch, lesser: str) -> None:
    """VISION_SERVE_CPU_VARIANT naming a variant without bf16 arithmetic, on an AMX CPU: the
    plan that class of CPU makes (bf16 widened for eager products, an fp32 vision tower, no
    AMX tiles), not a lesser build's kernels beside native bf16 that no machine runs; the
    CPU's own best variant keeps the CPU's plan."""
    import engine.kernels as kernels

    for name in ("avx512", "avx512_bf16", "avx512_vnni", "avx2"):
        monkeypatch.setattr(kernels, f"cpu_supports_{name}", lambda: True)
    monkeypatch.setattr(engine.device, "_torch_cpu_probe", lambda name: True)  # AMX, AVX512-BF16
    monkeypatch.delenv(kernels.VARIANT_ENV, raising=False)
    own = plan_platform(CPU, torch.bfloat16)
    assert own.bf16_arithmetic and own.kernel_variant == "native-bf16"
    assert own.vision_dtype == torch.bfloat16 and own.linear_kind != "bf16-upcast"

    monkeypatch.setenv(kernels.VARIANT_ENV, lesser)
    assert not engine.device.cpu_has_fast_bf16() and not engine.device.cpu_has_amx()
    plan = plan_platform(CPU, torch.bfloat16)
    assert not plan.bf16_arithmetic and plan.kernel_variant == lesser
    assert plan.linear_kind == "bf16-upcast" and plan.vision_dtype == torch.float32
    assert not plan.amx_attention and not plan.gemv_amx_tiles and not plan.torch_flash_attention
    assert engine.device.LESSER_CPU_LIBRARY_ENV[lesser]  # what the libraries are told

    monkeypatch.setenv(kernels.VARIANT_ENV, "native-bf16")
    assert plan_platform(CPU, torch.bfloat16) == own


def _rows(device: str, dtype: torch.dtype, requested: int | None = None) -> int | None:
    return encoder_rows_per_item(torch.device(device), dtype, requested)


def test_encoder_items_follow_the_device(monkeypatch) -> None:
    assert _rows("cuda", torch.bfloat16) is None  # whole stages
    assert _rows("cpu", torch.float32) == 256
    monkeypatch.setattr("engine.platform.cpu_has_amx", lambda: False)
    monkeypatch.setattr("engine.platform.cpu_has_fast_bf16", lambda: True)
    assert _rows("cpu", torch.bfloat16) == 64
    monkeypatch.setattr("engine.platform.cpu_has_amx", lambda: True)
    assert _rows("cpu", torch.bfloat16) == 512
    assert _rows("cpu", torch.float32) == 256
    monkeypatch.setattr("engine.platform.cpu_has_amx", lambda: False)
    monkeypatch.setattr("engine.platform.cpu_has_fast_bf16", lambda: False)
    assert _rows("cpu", torch.bfloat16) == 256
    assert _rows("cpu", torch.bfloat16, requested=32) == 32
    assert _rows("cpu", torch.bfloat16, requested=0) is None


def _plan(monkeypatch, fast_bf16: bool, variant: str | None = "avx2", amx: bool = False, **kw):
    import engine.kernels
    import engine.layers.linear

    monkeypatch.setattr("engine.platform.cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr("engine.platform.cpu_has_amx", lambda: amx)
    monkeypatch.setattr(engine.kernels, "cpu_variant", lambda: variant)
    monkeypatch.setattr(engine.layers.linear, "cpu_packing_available", lambda dtype: True)
    return plan_platform(torch.device("cpu"), kw.pop("dtype", torch.bfloat16), **kw)


def test_the_platform_plan_decides_together(monkeypatch) -> None:
    """bf16 arithmetic: oneDNN-packed linears, a bf16 tower, small encoder items; bf16
    emulated: weights kept bf16 and widened, an fp32 tower, 256-row items; int8: the fused
    kernel with bf16 activations, none with fp32 ones; the plan is one log line."""
    fast = _plan(monkeypatch, True, variant="native-bf16")
    assert (fast.linear_kind, fast.vision_dtype, fast.encoder_rows_per_item) == (
        "onednn-packed",
        torch.bfloat16,
        64,
    )
    assert fast.use_cpu_kernels and not fast.emulated_bf16
    # prompt steps ride the fused kernel up to 1,024 rows over oneDNN's GEMM, 16 over panels
    assert fast.fused_prompt_rows == 1024 and "fused_prompt_rows=1024" in fast.describe()
    assert not fast.torch_flash_attention and "prefill_attention=native" in fast.describe()
    # AMX: prompt chunks and the tower attend through our flash kernel with its products on
    # AMX tiles; without our kernels there, through torch's (AMX tiles too)
    amx = _plan(monkeypatch, True, variant="native-bf16", amx=True)
    assert amx.amx_attention and "prefill_attention=amx-tiles" in amx.describe()
    assert not amx.torch_flash_attention
    assert amx.fused_prompt_rows == 256 and amx.use_cpu_kernels
    assert amx.encoder_rows_per_item == 512
    no_kernels = _plan(monkeypatch, True, variant="native-bf16", amx=True, cpu_kernels=False)
    assert no_kernels.torch_flash_attention and not no_kernels.amx_attention
    assert "prefill_attention=torch-flash" in no_kernels.describe()
    assert not _plan(monkeypatch, True, amx=True, dtype=torch.float32).torch_flash_attention
    assert not _plan(monkeypatch, True, amx=True, dtype=torch.float32).amx_attention
    assert not fast.amx_attention  # AVX512-BF16 without AMX: the dot products
    # ... and the decode GEMV runs on AMX tiles, bf16 weights and int8 ones (from 5 rows)
    assert amx.gemv_amx_tiles and "gemv=amx-tiles" in amx.describe()
    assert not fast.gemv_amx_tiles and "gemv=dot" in fast.describe()
    int8_amx = _plan(monkeypatch, True, variant="native-bf16", amx=True, quantization="int8")
    assert int8_amx.gemv_amx_tiles
    int8_fast = _plan(monkeypatch, True, variant="native-bf16", quantization="int8")
    assert not int8_fast.gemv_amx_tiles
    # int8 activations: int16 beside AMX-INT8 tiles, int8 through the other integer products,
    # widened where AVX-512 has no VNNI (and unrounded without the fused step)
    assert int8_amx.int8_activation_bits == 16 and "int8_act_bits=16" in int8_amx.describe()
    assert int8_fast.int8_activation_bits == 8 and fast.int8_activation_bits is None
    assert int8_fast.int8_i16_rows == 4 and "(16 to 4 rows)" in int8_fast.describe()
    assert int8_amx.int8_i16_rows == 0 and fast.int8_i16_rows == 0
    assert "int8_act_bits" not in fast.describe()
    for variant, bits in [("emulated-bf16-vnni", 8), ("emulated-bf16", 0), ("avx2", 8)]:
        assert _plan(monkeypatch, False, variant, quantization="int8").int8_activation_bits == bits
    int8_eager = _plan(monkeypatch, True, quantization="int8", dtype=torch.float32)
    assert int8_eager.int8_activation_bits == 0
    assert not _plan(
        monkeypatch, True, variant="native-bf16", amx=True, cpu_kernels=False
    ).gemv_amx_tiles
    # the native GEMV prefetches weights and takes 16 rows on Intel, 12 on Zen 5, 16 rows on
    # Zen 4 (family 25: its bf16 panels) without the prefetch, neither on a CPU nobody measured
    for vendor, family, rows, ahead in (
        ("GenuineIntel", 6, 16, 4096),
        ("AuthenticAMD", 26, 12, 4096),
        ("AuthenticAMD", 25, 16, 0),
        ("", 0, 4, 0),
    ):
        monkeypatch.setattr("engine.platform.cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr("engine.platform.cpu_family", lambda family=family: family)
        native = _plan(monkeypatch, True, variant="native-bf16")
        assert (native.gemv_max_rows, native.weight_prefetch_bytes) == (rows, ahead)
        assert f"weight_prefetch={ahead}" in native.describe()
        int8_native = _plan(monkeypatch, True, variant="native-bf16", quantization="int8")
        assert (int8_native.gemv_max_rows, int8_native.weight_prefetch_bytes) == (4, 0)
    assert _plan(monkeypatch, False).weight_prefetch_bytes == 0  # emulated: compiled in
    emulated = _plan(monkeypatch, False)
    assert (emulated.linear_kind, emulated.vision_dtype, emulated.encoder_rows_per_item) == (
        "bf16-upcast",
        torch.float32,
        256,
    )
    assert emulated.use_cpu_kernels and emulated.emulated_bf16
    assert "kernels=avx2" in emulated.describe() and "linears=bf16-upcast" in emulated.describe()
    int8 = _plan(monkeypatch, False, quantization="int8")
    assert int8.linear_kind == "int8" and int8.use_cpu_kernels
    assert emulated.fused_prompt_rows == int8.fused_prompt_rows == 16
    int8_fp32 = _plan(monkeypatch, False, quantization="int8", dtype=torch.float32)
    assert int8_fp32.linear_kind == "int8" and not int8_fp32.use_cpu_kernels
    assert int8_fp32.fused_prompt_rows == 0
    assert not _plan(monkeypatch, False, variant=None).use_cpu_kernels  # no build applies
    fp32 = _plan(monkeypatch, False, dtype=torch.float32)
    assert fp32.linear_kind == "onednn-packed" and not fp32.use_cpu_kernels
    unpacked = _plan(monkeypatch, True, pack_cpu_weights=False)
    assert unpacked.linear_kind == "plain" and not unpacked.cpu_linears
    with pytest.raises(ValueError, match="CPU only"):
        plan_platform(torch.device("cuda"), torch.bfloat16, quantization="int8")


def test_a_lesser_plan_names_the_library_caps_it_lacks(monkeypatch, caplog) -> None:
    """torch, oneDNN and MKL read their caps at load: the start-up log says which are
    missing, so a figure taken without them is not mistaken for an AVX2 box's."""
    import engine.kernels as kernels
    from engine.device import LESSER_CPU_LIBRARY_ENV
    from engine.platform import _warn_unless_libraries_follow

    monkeypatch.setattr(kernels, "runnable_variants", lambda: ["native-bf16", "avx2"])
    monkeypatch.setenv(kernels.VARIANT_ENV, "avx2")
    for key in LESSER_CPU_LIBRARY_ENV["avx2"]:
        monkeypatch.delenv(key, raising=False)
    with caplog.at_level("WARNING", logger="engine"):
        _warn_unless_libraries_follow("avx2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in caplog.text and "ATEN_CPU_CAPABILITY=avx2" in caplog.text
    caplog.clear()
    for key, value in LESSER_CPU_LIBRARY_ENV["avx2"].items():
        monkeypatch.setenv(key, value)
    with caplog.at_level("WARNING", logger="engine"):
        _warn_unless_libraries_follow("avx2")
    assert caplog.text == ""
    monkeypatch.delenv(kernels.VARIANT_ENV)  # the CPU's own plan: nothing to say
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    with caplog.at_level("WARNING", logger="engine"):
        _warn_unless_libraries_follow("native-bf16")
    assert caplog.text == ""
