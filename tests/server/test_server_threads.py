"""The server's blocking helpers (``asyncio.to_thread``: image decoding, /tokenize's
preprocessing) run torch serially, so the engine's step loop keeps the only OpenMP team
(engine/openmp.py; the step loop's side is tests/engine/test_openmp_teams.py)."""

from __future__ import annotations

import asyncio
import threading

import torch


def test_to_thread_helpers_run_torch_on_one_thread(server):
    loop = server.server.servers[0].get_loop()

    async def probe() -> tuple[int, str]:
        return await asyncio.to_thread(
            lambda: (torch.get_num_threads(), threading.current_thread().name)
        )

    torch_threads, name = asyncio.run_coroutine_threadsafe(probe(), loop).result(timeout=30)
    assert torch_threads == 1
    assert name.startswith("server-io")
