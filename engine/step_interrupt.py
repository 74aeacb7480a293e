"""Stopping a long batch-only step when an interactive request arrives.

Why: on a CPU a step re-reads the decoder's weights, so camera prompts prefilled in short steps
(the step bound, ~50 ms) pay that floor many times: four frames alone ran 20-40 % slower than
under a fixed 2,048-token budget that prefills a frame in one step (2-core AMX Xeon,
``benchmarks.default_cost``). Short steps existed only so that a chat request arriving meanwhile
waits one short step, not a long one. An *interruptible* step gets both: with no interactive
work in the engine it may run many times the bound, and the step thread looks at this flag at
safe points -- after each decoder layer's attention, between its MLP's two products and between
layers, between vision work items -- and gives the step up when a chat request has been
queued. The layers already run are wasted (their KV rows are rewritten when the chunk runs
again, and nothing else reads them: positions past a request's computed tokens); the vision
items already run are kept.

The flag is raised by whoever queues an interactive request (the async engine's front end, on
another thread) and lowered by the step loop right before it takes queued requests in, so a
request queued after that moment raises it again for the next step.
"""

from __future__ import annotations

import threading


class StepInterrupted(Exception):
    """Raised inside an interruptible step's work when an interactive request is waiting."""


class StepInterrupt:
    """A thread-safe flag: "an interactive request is queued, end a batch-only step now"."""

    def __init__(self) -> None:
        self._flag = threading.Event()

    def request(self) -> None:
        self._flag.set()

    def clear(self) -> None:
        self._flag.clear()

    def requested(self) -> bool:
        return self._flag.is_set()

    def check(self) -> None:
        """Raise :class:`StepInterrupted` when the flag is up (the step's safe points call it)."""
        if self._flag.is_set():
            raise StepInterrupted
