"""Every benchmark script runs end to end on a tiny configuration, so none can rot.

Figures from these runs mean nothing; the scripts' real runs use the bench checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str, results: Path, timeout: int = 300) -> None:
    env = {**os.environ, "VISION_SERVE_RESULTS": str(results), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture
def results(tmp_path) -> Path:
    return tmp_path / "results"


@pytest.mark.slow
def test_offline_throughput_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.offline_throughput",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32", "--num-requests", "2",
        "--hf-requests", "1", "--max-tokens", "4", "--decode-tokens", "4",
        "--image-size", "112x112", "--out", "o.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "o.json").read_text())
    assert data["ours"]["generated_tokens"] == 8 and data["throughput_ratio"] > 0


@pytest.mark.slow
def test_offline_throughput_script_text_workload(tiny_qwen2_vl, results):
    _run(
        "benchmarks.offline_throughput",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32", "--num-requests", "2",
        "--hf-requests", "1", "--max-tokens", "4", "--decode-tokens", "4",
        "--image-size", "112x112", "--workload", "text", "--out", "t.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "t.json").read_text())
    assert data["args"]["workload"] == "text"
    assert data["ours"]["generated_tokens"] == 8 and data["throughput_ratio"] > 0


@pytest.mark.slow
def test_serve_mixed_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.serve_mixed",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32",
        "--modes", "chunked-16,adaptive-auto+wholeenc,default@1.5+int8", "--num-chat", "2",
        "--chat-min-tokens", "4", "--chat-max-tokens", "6", "--num-cameras", "2",
        "--camera-rate", "inf", "--camera-tokens", "2", "--image-size", "112x112",
        "--warmup-s", "0", "--alone-min-s", "0", "--capacity-rates", "4",
        "--capacity-cameras", "1", "--out", str(results / "mixed" / "m.json"),
        "--slo-itl-ms", "200,5000",
        "--server-args", f"--step-trace {results / 'steps.jsonl'}",
        results=results,
    )  # fmt: skip
    assert (results / "steps.jsonl").stat().st_size > 0  # our server took the extra flag
    results = results / "mixed"  # a path for --out: the JSON and the plots land there
    data = json.loads((results / "m.json").read_text())
    for mode in ("chunked-16", "adaptive-auto+wholeenc", "default@1.5+int8"):
        mixed = data["modes"][mode]["mixed"]
        assert mixed["chat"]["requests"] >= 2 and mixed["camera"]["errors"] == 0
        assert set(data["modes"][mode]["capacity_by_slo_itl_ms"]) == {"200.0", "5000.0"}
        assert set(data["modes"][mode]["stall_free_capacity_by_slo_itl_ms"]) == {"200.0", "5000.0"}
    assert (results / "m_itl_timeline.png").exists() and (results / "m_itl_cdf.png").exists()


@pytest.mark.slow
def test_front_end_cpu_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.front_end_cpu",
        "--model", str(tiny_qwen2_vl), "--num-chat", "2", "--max-tokens", "8",
        "--warmup", "1", "--seconds", "2",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "front_end_cpu.json").read_text())
    assert data["tokens"] > 0 and data["errors"] == 0
    # the event loop did work for the streamed tokens, and less than the whole process
    assert 0 < data["event_loop_us_per_token"] < data["step_threads_us_per_token"] * 10


@pytest.mark.slow
def test_roofline_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.roofline",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32", "--prompt-tokens", "64",
        "--decode-steps", "4", "--batches", "1,2", "--out", "r.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "r.json").read_text())
    assert data["prefill_mfu"] > 0 and set(data["decode"]) == {"1", "2"}


@pytest.mark.slow
def test_vision_tower_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.vision_tower",
        "--model", str(tiny_qwen2_vl), "--width", "112", "--height", "112",
        "--repeats", "1", "--dtypes", "fp32", "--out", "v.json",
        results=results,
    )  # fmt: skip
    assert json.loads((results / "v.json").read_text())["qwen2_vl"]["patches"] > 0


@pytest.mark.slow
def test_chunking_overhead_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.chunking_overhead",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32", "--prompt-tokens", "96",
        "--chunk", "32", "--image-size", "112x112", "--repeats", "2", "--out", "c.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "c.json").read_text())
    assert data["results"]["chunked"]["text"]["steps"] == 3
    assert data["results"]["one-shot"]["text"]["steps"] == 1
    assert set(data["ratios"]) == {"text", "frame"}


@pytest.mark.slow
def test_interactive_first_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.interactive_first",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32", "--frames", "2",
        "--chat-requests", "2", "--chat-tokens", "3", "--chat-gap-s", "0.05",
        "--frames-head-start-s", "0", "--num-chat", "1", "--chat-stream-tokens", "4",
        "--camera-tokens", "2", "--image-size", "112x112", "--warmup-s", "0",
        "--chat-alone-s", "0.5", "--out", "i.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "i.json").read_text())
    assert len(data["ttft_with_frames"]["ttft_s"]) == 2 and data["ttft_ratio"] > 0
    assert data["frames_alone"]["frames_per_min"] > 0
    assert data["frames_under_chat"]["frames_per_min"] > 0
    # the ideal share's reference: streams alone before and after the frames phase
    assert data["chat_alone"]["tokens"] > 0 and data["chat_alone_after"]["tokens"] > 0
    # the chat part of each step: predicted, scaled by what such steps measured alone
    share = data["camera_share_left"]
    assert share["chat_decode_scale"] > 0 and 0 <= share["share_left"] <= 1
    # and, without the cost model, the chat throughput the frames took
    assert data["chat_alone"]["chat_tokens_per_s"] > 0
    assert 0 <= data["throughput_share_left"] <= 1


@pytest.mark.slow
def test_interactive_first_ttft_only(tiny_qwen2_vl, results):
    _run(
        "benchmarks.interactive_first", "--ttft-only", "--ttft-rounds", "2",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32", "--frames", "2",
        "--chat-requests", "2", "--chat-tokens", "3", "--chat-gap-s", "0.01",
        "--frames-head-start-s", "0", "--image-size", "112x112", "--camera-tokens", "64",
        "--out", "t.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "t.json").read_text())
    assert len(data["ttft_alone_s"]) == 4  # 2 requests a round, 2 rounds
    assert len(data["ttft_with_frames_s"]) <= 4
    assert data["ttft_ratio"] is None or data["ttft_ratio"] > 0


def test_chat_share_scales_the_predicted_chat_part_by_what_it_measured_alone(tmp_path):
    """The camera's share of a step is its time past the chat decodes' part; that part is
    the cost model's prediction times measured / predicted of the decode-only chat steps while
    the streams ran alone (a server whose chat steps ran 27 % over their prediction counted
    that 27 % as the camera's)."""
    from benchmarks.interactive_first import chat_decode_scale, chat_share_from_trace

    def step(at: float, step_s: float, chat: float | None, prefill: int = 0, enc: int = 0):
        return {"at": at, "step_s": step_s, "chat_decode_s": chat,
                "prefill_tokens": prefill, "encoder_items": enc}  # fmt: skip

    alone = [step(t, 0.024, 0.020) for t in range(10)]  # 1.2x the prediction
    alone += [step(10, 0.050, 0.020, prefill=30)]  # a chat prompt step: not a reference
    phase = [step(100 + t, 0.040, 0.020, enc=1) for t in range(10)]
    trace = tmp_path / "steps.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in alone + phase))
    scale = chat_decode_scale(trace, [[0, 10]])
    assert scale == pytest.approx(1.2)
    share = chat_share_from_trace(trace, [100, 110], scale)
    assert share["steps"] == 10
    assert share["share_left"] == pytest.approx(10 * (0.040 - 0.024) / 10)
    assert share["share_left_unscaled"] == pytest.approx(10 * (0.040 - 0.020) / 10)
    assert chat_decode_scale(trace, [[50, 60]]) == 1.0  # nothing measured: unscaled


@pytest.mark.slow
def test_int8_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.int8",
        "--model", str(tiny_qwen2_vl), "--steps", "2", "--prompts", "2", "--max-tokens", "4",
        "--batches", "1", "2", "--rounds", "2",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "int8.json").read_text())
    assert data["int8"]["weight_mb_per_step"] < data["baseline"]["weight_mb_per_step"]
    assert all(len(v) == 2 for v in data["int8"]["decode_step_ms_rounds"].values())
    assert 0 <= data["agreement"]["token_agreement"] <= 1


@pytest.mark.slow
def test_load_memory_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.load_memory",
        "--model", str(tiny_qwen2_vl), "--rounds", "2", "--steps", "3",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "load_memory.json").read_text())
    kept, plan = data["summary"]["row-major kept"], data["summary"]["plan"]
    assert kept["row_major_held"] in (True, None)  # None: no fused decoder on this CPU
    assert plan["row_major_held"] in (True, False, None)
    assert kept["resident_mib"] > 0 and len(plan["decode_step_ms_b1_rounds"]) == 2
    assert "gemv_1_row=" in data["plan"]


@pytest.mark.slow
def test_gemv_script(results):
    from engine.kernels import load_cpu_decode

    kernels = load_cpu_decode()
    if kernels is None:
        pytest.skip("engine.kernels do not build on this CPU")
    _run(
        "benchmarks.gemv", "--rows", "1", "17", "--layers", "1", "--repeats", "1", "--lm-head",
        "--out", "g.json", results=results,
    )  # fmt: skip
    data = json.loads((results / "g.json").read_text())
    assert set(data["ms"]) == {"1", "17"}
    # every path this build and CPU have, each within its row limit
    paths = {"int8-panel", "bf16-rowmajor", "bf16-panel"}
    paths |= {"int8-tile"} if kernels.amx_int8_usable() else set()
    assert set(data["ms"]["1"]) == paths | ({"bf16-tile"} if kernels.amx_usable() else set())
    assert set(data["ms"]["17"]) == paths - {"bf16-rowmajor"}
    assert all(ms > 0 for row in data["ms"].values() for ms in row.values())


@pytest.mark.slow
def test_attention_script(results):
    from engine.kernels import load_cpu_decode

    kernels = load_cpu_decode()
    if kernels is None:
        pytest.skip("engine.kernels do not build on this CPU")
    _run("benchmarks.attention", "--repeats", "1", "--out", "a.json", results=results)
    data = json.loads((results / "a.json").read_text())
    assert data["amx"] == bool(kernels.amx_usable())
    variants = {"dot", "sdpa", "amx"} if data["amx"] else {"dot", "sdpa"}
    assert len(data["rows"]) == 7 and all(set(r["ms"]) == variants for r in data["rows"])
    assert all(ms > 0 for r in data["rows"] for ms in r["ms"].values())


@pytest.mark.slow
def test_step_overhead_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.step_overhead",
        "--model", str(tiny_qwen2_vl), "--dtype", "bfloat16", "--batches", "1", "3",
        "--tokens", "4", "--out", "s.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "s.json").read_text())
    for batch in ("1", "3"):
        row = data["batches"][batch]
        assert row["steps"] >= 3 and 0 < row["kernel_ms"] < row["step_ms_mean"]


@pytest.mark.slow
def test_encoder_beside_chat_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.encoder_beside_chat",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32", "--num-chat", "2",
        "--frames", "1", "--image-size", "112x112", "--warm-steps", "8",
        "--frame-gap-steps", "12", "--steps", "12", "--out", "e.json",
        results=results,
    )  # fmt: skip
    out = json.loads((results / "e.json").read_text())
    summary = out["summary"]
    assert summary["steps"] >= 1 and summary["encoder_units"] > 0
    assert summary["whole_frame_ms_per_unit"] > 0 and summary["slice_efficiency"] > 0
    prices = summary["item_prices"]  # every kind a frame's encode runs, priced beside chat
    assert prices and all(row["items"] > 0 and row["us_per_unit"] > 0 for row in prices.values())
    # priced over every step with chat decodes in it, a superset of the summary's steps
    recorded = sum(step["encoder_units"] for step in out["steps"])
    assert 0 < sum(row["units"] for row in prices.values()) <= recorded * (1 + 1e-6)


@pytest.mark.slow
def test_default_cost_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.default_cost",
        "--model", str(tiny_qwen2_vl), "--dtype", "float32", "--repeats", "2",
        "--frames", "2", "--image-size", "112x112", "--num-chat", "2",
        "--prompt-tokens", "16", "--chat-tokens", "4", "--out", "d.json",
        results=results,
    )  # fmt: skip
    out = json.loads((results / "d.json").read_text())["results"]
    for workload in ("camera", "chat"):
        assert len(out[workload]["pairs_s"]) == 2
        assert out[workload]["default_per_unit"] > 0 and out[workload]["fixed_per_unit"] > 0


def test_step_trace_summary_script(tmp_path, results):
    trace = tmp_path / "steps.jsonl"
    step = {"predicted_s": 0.03, "target_s": 0.03, "encoder_grant": 90.0, "item_overhead": 10.0}
    lines = [
        {**step, "at": 100.0 + 0.03 * i, "step_s": 0.03, "decodes": 4, "prefill_tokens": 0,
         "encoder_units": 40.0, "encoder_items": 1, "encoder_s": 0.004, "forward_s": 0.025}
        for i in range(50)
    ]  # fmt: skip
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    _run("benchmarks.step_trace_summary", str(trace), "--window", "1", "--out", "s.json",
         results=results)  # fmt: skip
    windows = json.loads((results / "s.json").read_text())["windows"]
    assert sum(w["steps"] for w in windows) == 50
    assert windows[0]["encoder_ms_per_unit"] == pytest.approx(0.1)
    assert windows[0]["chat_step_ms_p50"] == pytest.approx(30.0)
    # one row per phase of a result with wall_window spans (interactive_first's), in time order
    phases = tmp_path / "phases.json"
    spans = {"late": {"wall_window": [100.6, 101.0]}, "early": {"wall_window": [100.0, 100.59]}}
    phases.write_text(json.dumps(spans))
    _run("benchmarks.step_trace_summary", str(trace), "--phases", str(phases), "--out", "p.json",
         results=results)  # fmt: skip
    rows = json.loads((results / "p.json").read_text())["windows"]
    assert [r["phase"] for r in rows] == ["early", "late"]
    assert [r["steps"] for r in rows] == [20, 14]
    assert rows[0]["encoder_units_per_step_p50"] == pytest.approx(40.0)


@pytest.mark.slow
def test_weight_prefetch_script(tiny_qwen2_vl, results):
    _run(
        "benchmarks.weight_prefetch",
        "--model", str(tiny_qwen2_vl), "--batches", "1", "2", "--distances", "0", "4096",
        "--gemv-rows", "1", "4", "--rounds", "2", "--steps", "3", "--out", "wp.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "wp.json").read_text())
    if data.get("skipped"):
        return  # no native-bf16 build here: the script says so and saves that
    assert set(data["median_step_ms"]) == {"1", "2"}
    # 2 limits x 2 distances of the dot product, 2 limits on panels from 1 row, and 2 limits on
    # AMX tiles where they run
    from engine.kernels import load_cpu_decode

    variants = 4 + 2 + 2 * bool(load_cpu_decode().amx_usable())
    assert all(len(row) == variants for row in data["median_step_ms"].values())
    assert data["gemv_kind"] in ("dot", "panels", "amx-tiles")
    assert all(ms > 0 for row in data["median_step_ms"].values() for ms in row.values())


def test_openmp_teams_script(results):
    _run(
        "benchmarks.openmp_teams", "--rounds", "1", "--iters", "200", "--out", "o.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "o.json").read_text())
    assert set(data["median_us"]) == {"one team", "two teams"}
    assert all(us > 0 for us in data["median_us"].values())


def test_decode_graphs_script(tiny_qwen2_vl, results):
    """A GPU benchmark: without CUDA it says so and saves a skipped record; with it, a table."""
    _run(
        "benchmarks.decode_graphs",
        "--model", str(tiny_qwen2_vl), "--batches", "1", "3", "--contexts", "20",
        "--rounds", "1", "--steps", "4", "--kv-cache-memory-gb", "0.1", "--out", "g.json",
        results=results,
    )  # fmt: skip
    data = json.loads((results / "g.json").read_text())
    import torch

    if not torch.cuda.is_available():
        assert data["skipped"] is True
        return
    assert [(r["context"], r["batch"]) for r in data["table"]] == [(20, 1), (20, 3)]
    assert all(r["graphs_s"] > 0 and r["eager_s"] > 0 for r in data["table"])
    assert data["graphs_captured"] >= 2
