"""Summarise a ``--step-trace`` file window by window: how long chat steps ran, how much
camera work they carried, what the budget allowed.

A server started with ``--step-trace steps.jsonl`` (or ``VISION_SERVE_STEP_TRACE``) writes one
line per step; this prints, per ``--window`` seconds: steps, those with ``--min-decodes``
decodes or more (chat steps) and their median / p99 time, encoder units and items run, the
encoder's own ms per unit and per item, prompt tokens, and the median time limit the budget
applied to the chat steps, and the median share of a chat step's wall time its thread spent on
a CPU (well under 1: it waited for the GIL, a core or its OpenMP workers).

    python -m benchmarks.step_trace_summary steps.jsonl [--window 30] [--min-decodes 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common import save_json


def load(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise SystemExit(f"{path}:{n}: not a JSON line (a trace cut mid-write?)") from None
    if not rows:
        raise SystemExit(f"{path}: no steps")
    return rows


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(rows: list[dict], window_s: float, min_decodes: int) -> list[dict]:
    start = rows[0]["at"]
    windows: dict[int, list[dict]] = {}
    for row in rows:
        windows.setdefault(int((row["at"] - start) // window_s), []).append(row)
    out = []
    for index in sorted(windows):
        steps = windows[index]
        chat = [r for r in steps if r["decodes"] >= min_decodes]
        units = sum(r["encoder_units"] for r in steps)
        items = sum(r["encoder_items"] for r in steps)
        encoder_s = sum(r["encoder_s"] for r in steps)
        limits = [r["target_s"] for r in chat if r.get("target_s")]
        cpu = [r["cpu_s"] / r["step_s"] for r in chat if r.get("cpu_s") and r["step_s"] > 0]
        out.append(
            {
                "from_s": index * window_s,
                "steps": len(steps),
                "chat_steps": len(chat),
                "chat_step_ms_p50": 1e3 * statistics.median(r["step_s"] for r in chat)
                if chat
                else None,
                "chat_step_ms_p99": 1e3 * _p([r["step_s"] for r in chat], 0.99) if chat else None,
                # the step thread's CPU time over its wall time (older traces have none)
                "chat_cpu_share_p50": statistics.median(cpu) if cpu else None,
                "encoder_units": units,
                "encoder_items": items,
                "encoder_ms_per_unit": 1e3 * encoder_s / units if units else None,
                "encoder_ms_per_item": 1e3 * encoder_s / items if items else None,
                "prefill_tokens": sum(r["prefill_tokens"] for r in steps),
                "chat_limit_ms_p50": 1e3 * statistics.median(limits) if limits else None,
            }
        )
    return out


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--window", type=float, default=30.0, help="seconds per row")
    ap.add_argument("--min-decodes", type=int, default=3, help="a chat step has this many")
    ap.add_argument("--out", default=None, help="also save the table as JSON (results/)")
    args = ap.parse_args()
    table = summarise(load(args.trace), args.window, args.min_decodes)
    print(
        "from s | steps | chat steps | chat ms p50/p99 | encoder units/items | "
        "ms per unit/item | prompt tokens | chat limit ms | chat cpu/wall"
    )
    for w in table:
        print(
            f"{w['from_s']:6.0f} | {w['steps']:5d} | {w['chat_steps']:10d} | "
            f"{_fmt(w['chat_step_ms_p50'])}/{_fmt(w['chat_step_ms_p99'])} | "
            f"{w['encoder_units']:.0f}/{w['encoder_items']} | "
            f"{_fmt(w['encoder_ms_per_unit'], '.3f')}/{_fmt(w['encoder_ms_per_item'])} | "
            f"{w['prefill_tokens']} | {_fmt(w['chat_limit_ms_p50'])} | "
            f"{_fmt(w['chat_cpu_share_p50'], '.2f')}"
        )
    if args.out:
        save_json(args.out, {"windows": table, "args": {**vars(args), "trace": str(args.trace)}})


if __name__ == "__main__":
    main()
