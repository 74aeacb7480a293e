"""What a sink is to the notifier: ``deliver(event)`` returns once the receiver has it
(``Delivered``) or it is given up on (``Dead``); until then the sink retries by itself.

The notifier acknowledges the stream entry only on one of those two answers. A sink that is
told to stop mid-way raises ``pipelines.worker.Stopping`` (as ``Hooks.sleep`` does) and the
entry stays pending, to be sent again (same event id) by the next notifier.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from pipelines.notify.event import Event


@dataclass(frozen=True)
class Delivered:
    attempts: int


@dataclass(frozen=True)
class Dead:
    reason: str  # rejected | max_attempts
    detail: str
    attempts: int


Result = Delivered | Dead


@dataclass
class Hooks:
    """What the notifier lends each sink: an interruptible sleep (raises ``Stopping``), a wait
    for the stop request, and a callback per failed attempt that will be retried."""

    sleep: Callable[[float], Awaitable[None]]
    stopped: Callable[[], Awaitable[None]]
    retry: Callable[[str, str], None]  # (sink name, reason)


class Sink(Protocol):
    name: str

    async def start(self) -> None: ...

    async def deliver(self, event: Event) -> Result: ...

    async def close(self) -> None: ...
