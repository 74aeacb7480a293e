"""Host memory after load, and the 1-row decode step, with the native build's row-major copy
of the decoder kept or let go (engine/platform.py ``gemv_row_major_needed``).

    python -m benchmarks.load_memory                 # bench checkpoint, --dtype auto
    python -m benchmarks.load_memory --model DIR --rounds 2 --steps 8   # smoke

Resident memory is per process: each variant loads in a process of its own and reports its
resident MiB after load (the engine trims glibc's heap then, engine/host_memory.py) and its
platform plan. The decode steps are timed in this process, both engines loaded side by side
and timed in turns for ``--rounds`` rounds, order reversed every round: the machines here move
20-40 % between minutes, separate processes minutes apart compared nothing. On builds other
than the native-bf16 one, and on AMX, both variants hold the copy and the figures agree.

Writes results/load_memory.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from benchmarks.common import bench_checkpoint, checkpoint_args, log, save_json, setup_env
from benchmarks.int8 import decode_step_ms

VARIANTS = ("plan", "row-major kept")


def load(model: str, dtype: str, variant: str):
    """An engine as the plan makes it, or with the row-major copy kept whatever the plan."""
    import engine.platform as platform
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

    needed = platform.gemv_row_major_needed
    if variant == "row-major kept":
        platform.gemv_row_major_needed = lambda prefetch_bytes, amx_tiles: True
    try:
        return LLMEngine(EngineArgs(model=model, dtype=dtype))
    finally:
        platform.gemv_row_major_needed = needed


def row_major_held(eng) -> bool | None:
    fused = eng.runner.fused_decoder
    return None if fused is None else bool(getattr(fused, "row_major", True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    checkpoint_args(ap, dtype="auto")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    setup_env()
    model = str(bench_checkpoint(args.family, args.model))
    if args.child:
        from engine.host_memory import resident_mib

        eng = load(model, args.dtype, args.child)
        out = {"resident_mib": resident_mib(), "row_major_held": row_major_held(eng)}
        print("RESULT " + json.dumps({**out, "plan": eng.platform.describe()}))
        return
    memory = {}
    for variant in VARIANTS:
        cmd = [sys.executable, "-m", "benchmarks.load_memory", "--model", model]
        cmd += ["--dtype", args.dtype, "--child", variant]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{variant}: no result\n{proc.stderr[-3000:]}")
        memory[variant] = json.loads(line[len("RESULT ") :])
        log(f"{variant}: {memory[variant]}")
    engines = {v: load(model, args.dtype, v) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            times[variant].append(decode_step_ms(engines[variant], 1, args.steps))
    summary = {
        v: {
            "resident_mib": memory[v]["resident_mib"],
            "row_major_held": memory[v]["row_major_held"],
            "decode_step_ms_b1": statistics.median(times[v]),
            "decode_step_ms_b1_rounds": times[v],
        }
        for v in VARIANTS
    }
    for v, s in summary.items():
        log(
            f"{v}: {s['resident_mib']:.0f} MiB resident, row-major held {s['row_major_held']}, "
            f"batch-1 decode step {s['decode_step_ms_b1']:.2f} ms (rounds: "
            + ", ".join(f"{t:.2f}" for t in s["decode_step_ms_b1_rounds"])
            + ")"
        )
    save_json("load_memory.json", {"summary": summary, "plan": memory["plan"]["plan"]})


if __name__ == "__main__":
    main()
