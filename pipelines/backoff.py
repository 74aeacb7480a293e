"""Exponential backoff with jitter, shared by every reconnect loop.

Why one helper: cameras, the Redis enqueuer and the describers all retry forever against
things that come back (a camera reboot, a Redis restart, a VLM redeploy). Doubling delays
keep a dead peer from being hammered; jitter keeps many cameras from reconnecting in step;
``reset()`` after a success makes the next outage start fast again.
"""

from __future__ import annotations

import random
import threading


class Backoff:
    """Delays ``initial, 2*initial, 4*initial ...`` capped at ``maximum``, each +-20% jitter."""

    def __init__(self, initial: float, maximum: float, jitter: float = 0.2) -> None:
        self.initial = initial
        self.maximum = max(maximum, initial)
        self.jitter = jitter
        self.attempts = 0

    def next_delay(self) -> float:
        """The delay before the next attempt; each call counts one failed attempt."""
        base = min(self.maximum, self.initial * (2 ** min(self.attempts, 32)))
        self.attempts += 1
        return base * (1.0 + random.uniform(-self.jitter, self.jitter))

    def reset(self) -> None:
        """Forget past failures (call after a success)."""
        self.attempts = 0

    def wait(self, stop: threading.Event) -> bool:
        """Sleep the next delay unless ``stop`` is set first; True when stopping."""
        return stop.wait(self.next_delay())
