"""What a second OpenMP team costs every parallel region (why engine/openmp.py exists).

Times one small parallel torch op (``--elements`` floats, above torch's grain size, so both
threads take part) with only the main thread's team, then after a helper thread has run one op
of its own (libgomp keeps that thread's team; with more team threads than CPUs, every team
sleeps at barriers), then after the helper released it (``engine.openmp.release_team``), in
``--rounds`` turns. Run it held to as many CPUs as torch has threads (the server's case):

    taskset -c 0,1 python -m benchmarks.openmp_teams [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time

import torch

from benchmarks.common import log, save_json


def op_us(x: torch.Tensor, out: torch.Tensor, iters: int) -> float:
    for _ in range(iters // 20):
        torch.mul(x, 2, out=out)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.mul(x, 2, out=out)
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--elements", type=int, default=200_000)
    ap.add_argument("--out", default="openmp_teams.json")
    args = ap.parse_args()
    from engine import openmp

    cpus = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    if threads < cpus:
        log(f"torch has {threads} threads on {cpus} CPUs: a second team may not throttle")
    x = torch.randn(args.elements)
    out = torch.empty_like(x)
    commands: queue.Queue[str] = queue.Queue()
    done: queue.Queue[None] = queue.Queue()

    def helper() -> None:
        while (command := commands.get()) != "stop":
            if command == "team":
                (x * 2).sum()
            else:
                openmp.release_team()
            done.put(None)

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    rows: dict[str, list[float]] = {"one team": [], "two teams": []}
    for _ in range(args.rounds):
        rows["one team"].append(op_us(x, out, args.iters))
        commands.put("team")
        done.get()
        rows["two teams"].append(op_us(x, out, args.iters))
        commands.put("release")
        done.get()
    commands.put("stop")
    result = {
        "cpus": cpus,
        "torch_threads": threads,
        "elements": args.elements,
        "us_per_op": rows,
        "median_us": {k: statistics.median(v) for k, v in rows.items()},
    }
    for name, values in rows.items():
        print(
            f"{name:>9}: {statistics.median(values):6.1f} µs per op (rounds: "
            + ", ".join(f"{v:.1f}" for v in values)
            + ")"
        )
    save_json(args.out, result)


if __name__ == "__main__":
    main()
