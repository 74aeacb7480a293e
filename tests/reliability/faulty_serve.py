"""``vision-serve`` with a fault planted in the engine step, for the process-exit test.

Run as ``python -m tests.reliability.faulty_serve serve ...``: the real CLI and server, except
that ``LLMEngine.step`` raises once a request whose prompt holds :data:`STEP_FAULT_MARKER` is in
the scheduler, as a bug or a device error in the batched forward would.
"""

from __future__ import annotations

import sys

from engine.llm_engine import LLMEngine
from vision_serve.cli import main

STEP_FAULT_MARKER = "<<kill-the-step>>"


def plant_step_fault(engine_cls: type[LLMEngine] = LLMEngine) -> None:
    original = engine_cls.step

    def step(self: LLMEngine) -> list:
        for req in self.scheduler.requests.values():
            if STEP_FAULT_MARKER in (req.prompt.prompt or ""):
                raise RuntimeError("injected fault in the engine step")
        return original(self)

    engine_cls.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    plant_step_fault()
    sys.exit(main(sys.argv[1:]))
