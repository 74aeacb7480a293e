"""Summarise a ``--step-trace`` file window by window: how long chat steps ran, how much
camera work they carried, what the budget allowed.

A server started with ``--step-trace steps.jsonl`` (or ``VISION_SERVE_STEP_TRACE``) writes one
line per step; this prints, per ``--window`` seconds: steps, those with ``--min-decodes``
decodes or more (chat steps) and their median / p99 time, encoder units and items run, the
encoder's own ms per unit and per item, prompt tokens, and the median time limit the budget
applied to the chat steps, and the median share of a chat step's wall time its thread spent on
a CPU (well under 1: it waited for the GIL, a core or its OpenMP workers).

    python -m benchmarks.step_trace_summary steps.jsonl [--window 30] [--min-decodes 3]
    python -m benchmarks.step_trace_summary steps.jsonl --phases results/interactive_first.json

``--phases``: one row per phase of a benchmark result that records its phases' wall-clock
spans (``wall_window``: ``interactive_first``'s frames alone, chat alone, frames under chat),
so the camera's work alone and beside chat compare directly -- its encoder's µs a unit and
units a step, the prompt tokens and the forward time past chat's predicted decode.
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


def by_window(rows: list[dict], window_s: float) -> list[tuple[float, list[dict]]]:
    """The steps in consecutive ``window_s`` windows, each with its start (s into the trace)."""
    start = rows[0]["at"]
    windows: dict[int, list[dict]] = {}
    for row in rows:
        windows.setdefault(int((row["at"] - start) // window_s), []).append(row)
    return [(index * window_s, windows[index]) for index in sorted(windows)]


def phase_spans(result: object, path: str = "") -> list[tuple[str, float, float]]:
    """(name, start, end) of every ``wall_window`` in a benchmark result, in time order."""
    spans: list[tuple[str, float, float]] = []
    if isinstance(result, dict):
        for key, value in result.items():
            if key == "wall_window" and isinstance(value, list) and len(value) == 2:
                spans.append((path or "run", float(value[0]), float(value[1])))
            else:
                spans += phase_spans(value, f"{path}/{key}".lstrip("/"))
    elif isinstance(result, list):
        for i, value in enumerate(result):
            spans += phase_spans(value, f"{path}[{i}]")
    return sorted(spans, key=lambda span: span[1])


def by_phase(rows: list[dict], result: dict) -> list[tuple[str, list[dict]]]:
    spans = phase_spans(result)
    if not spans:
        raise SystemExit("--phases: no wall_window in that result (interactive_first writes them)")
    return [(name, [r for r in rows if t0 <= r["at"] <= t1]) for name, t0, t1 in spans]


def summarise(rows: list[dict], window_s: float, min_decodes: int) -> list[dict]:
    return [
        {"from_s": start, **summarise_steps(steps, min_decodes)}
        for start, steps in by_window(rows, window_s)
    ]


def summarise_steps(steps: list[dict], min_decodes: int) -> dict:
    """One row of the table: what ``steps`` ran and how long it took."""
    chat = [r for r in steps if r["decodes"] >= min_decodes]
    units = sum(r["encoder_units"] for r in steps)
    items = sum(r["encoder_items"] for r in steps)
    encoder_s = sum(r["encoder_s"] for r in steps)
    limits = [r["target_s"] for r in chat if r.get("target_s")]
    cpu = [r["cpu_s"] / r["step_s"] for r in chat if r.get("cpu_s") and r["step_s"] > 0]
    with_encoder = [r["encoder_units"] for r in steps if r["encoder_units"] > 0]
    prompt = [r for r in steps if r["prefill_tokens"] > 0 and r.get("forward_s") is not None]
    prompt_tokens = sum(r["prefill_tokens"] for r in prompt)
    past_chat_s = sum(r["forward_s"] - (r.get("chat_decode_s") or 0.0) for r in prompt)
    return {
        "steps": len(steps),
        "chat_steps": len(chat),
        "chat_step_ms_p50": 1e3 * statistics.median(r["step_s"] for r in chat) if chat else None,
        "chat_step_ms_p99": 1e3 * _p([r["step_s"] for r in chat], 0.99) if chat else None,
        # the step thread's CPU time over its wall time (older traces have none)
        "chat_cpu_share_p50": statistics.median(cpu) if cpu else None,
        "encoder_units": units,
        "encoder_items": items,
        "encoder_ms_per_unit": 1e3 * encoder_s / units if units else None,
        "encoder_ms_per_item": 1e3 * encoder_s / items if items else None,
        # the size of the encoder's pieces: whole items alone, what the ITL target
        # leaves beside chat
        "encoder_units_per_step_p50": statistics.median(with_encoder) if with_encoder else None,
        "prefill_tokens": sum(r["prefill_tokens"] for r in steps),
        # forward time of steps with prompt rows past chat's predicted decode, a token
        "prompt_ms_per_token": 1e3 * past_chat_s / prompt_tokens if prompt_tokens else None,
        "chat_limit_ms_p50": 1e3 * statistics.median(limits) if limits else None,
    }


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--window", type=float, default=30.0, help="seconds per row")
    ap.add_argument("--min-decodes", type=int, default=3, help="a chat step has this many")
    ap.add_argument("--out", default=None, help="also save the table as JSON (results/)")
    ap.add_argument(
        "--phases", type=Path, default=None, help="a result with wall_window spans: one row each"
    )
    args = ap.parse_args()
    rows = load(args.trace)
    if args.phases is not None:
        phases = by_phase(rows, json.loads(args.phases.read_text()))
        table = [{"phase": n, **summarise_steps(steps, args.min_decodes)} for n, steps in phases]
    else:
        table = summarise(rows, args.window, args.min_decodes)
    print(
        f"{'phase' if args.phases else 'from s'} | steps | chat steps | chat ms p50/p99 | "
        "encoder units/items | ms per unit/item | units a step | prompt tokens | "
        "prompt ms a token | chat limit ms | chat cpu/wall"
    )
    for w in table:
        label = w["phase"] if "phase" in w else f"{w['from_s']:6.0f}"
        print(
            f"{label} | {w['steps']:5d} | {w['chat_steps']:10d} | "
            f"{_fmt(w['chat_step_ms_p50'])}/{_fmt(w['chat_step_ms_p99'])} | "
            f"{w['encoder_units']:.0f}/{w['encoder_items']} | "
            f"{_fmt(w['encoder_ms_per_unit'], '.3f')}/{_fmt(w['encoder_ms_per_item'])} | "
            f"{_fmt(w['encoder_units_per_step_p50'], '.0f')} | {w['prefill_tokens']} | "
            f"{_fmt(w['prompt_ms_per_token'], '.2f')} | {_fmt(w['chat_limit_ms_p50'])} | "
            f"{_fmt(w['chat_cpu_share_p50'], '.2f')}"
        )
    if args.out:
        given = {**vars(args), "trace": str(args.trace), "phases": str(args.phases or "")}
        save_json(args.out, {"windows": table, "args": given})


if __name__ == "__main__":
    main()
