"""One JSON line per engine step: what the step budget promised and what the step did.

Why: whether chat keeps its ITL beside camera work, and how much camera work the time it leaves
buys, is decided step by step (target, prediction, encoder grant, item price) and is invisible
in request-level metrics. A server run with ``--step-trace PATH`` shows it directly: session 14
found from such a trace that, under a streaming client on the same 2 cores, every step beside
chat ran one 16-row vision piece whose wall time was twice its CPU time. Off by default (a line
per step is ~40 per second).

Fields (seconds unless named otherwise): ``at`` wall clock, ``step_s`` measured, ``cpu_s`` the
step thread's CPU time (well under ``step_s``: the thread slept -- on the GIL, on a core taken by
another process, at a barrier its OpenMP workers reached late -- rather than computed),
``predicted_s`` and ``target_s`` (the step's time limit: the ITL target beside chat, else the
step bound; None under a plain token budget) from the budget, ``decodes`` / ``prefill_tokens``,
``held_decodes`` (batch decodes held out of an encoder-only step), ``encoder_grant`` (units
granted), ``encoder_units`` / ``encoder_items`` / ``encoder_s`` (what ran and its own time),
``item_overhead`` (units charged per item), ``forward_s`` (the language model's forward and
sampling), ``chat_decode_s`` (predicted time of the step's interactive decodes alone: what chat
would take of it without camera work), ``interruptible`` / ``interrupted`` (a batch-only step
that may give way to a chat request, and whether it did: engine/step_interrupt.py), ``paced``
(batch work beside chat decodes under the ITL target: its measured / predicted time paces the
next such steps, ``engine.step_budget.BesideChatPace``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import TextIO

log = logging.getLogger("engine")


class StepTraceError(ValueError):
    """The trace file cannot be opened (start-up refuses with this one line)."""


class StepTrace:
    """Appends step records to a file; flushed every ``flush_every`` records and on close."""

    def __init__(self, path: str | Path, flush_every: int = 64) -> None:
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise StepTraceError(f"--step-trace {str(path)!r}: {exc.strerror or exc}") from None
        self.flush_every = flush_every
        self._pending = 0

    def record(self, sched, result, step_s: float, cpu_s: float | None = None) -> None:
        """One step: ``sched`` the scheduler's output, ``result`` the runner's (None when the
        step ran nothing), ``cpu_s`` the step thread's own CPU time."""
        if self._file is None:
            return
        line = {
            "at": round(time.time(), 4),
            "step_s": step_s,
            "cpu_s": cpu_s,
            "predicted_s": sched.predicted_s,
            "target_s": sched.target_s,
            "decodes": sched.num_decode_tokens,
            "held_decodes": sched.held_decodes,
            "prefill_tokens": sched.num_prefill_tokens,
            "encoder_grant": sum(v for v in sched.encoder_work.values() if v != float("inf")),
            "item_overhead": sched.encoder_item_overhead,
            "encoder_units": result.encoder_units if result else 0.0,
            "encoder_items": result.encoder_items if result else 0,
            "encoder_s": result.encoder_work_s if result else 0.0,
            "forward_s": result.forward_s if result else 0.0,
            "chat_decode_s": sched.chat_decode_s,
            "paced": sched.paced,
            "interruptible": sched.interruptible,
            "interrupted": bool(result and result.interrupted),
        }
        try:
            self._file.write(json.dumps(line) + "\n")
            self._pending += 1
            if self._pending >= self.flush_every:
                self._file.flush()
                self._pending = 0
        except OSError as exc:  # a full disk ends the trace, never the engine
            log.warning("step trace %s stopped: %s", self.path, exc)
            self.close()

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            # a buffer that cannot be flushed (full disk) was reported by record(), or is moot
            with contextlib.suppress(OSError):
                file.close()
