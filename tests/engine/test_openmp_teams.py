"""One OpenMP team in a serving process (engine/openmp.py).

Each scenario runs in a fresh interpreter held to two CPUs with two torch threads: libgomp
throttles its spinning once its teams hold more threads than the process has CPUs, and this
test process has run torch on many threads already. What is checked is what libgomp and the
kernel report (threads alive, a thread's torch thread count, the step thread's voluntary
context switches), never a duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, os, sys, threading
cpus = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, cpus)
import torch
torch.set_num_threads(2)
from engine import openmp
def threads():
    return len(os.listdir("/proc/self/task"))
big = torch.randn(1_000_000)
"""

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux /proc and two CPUs",
)


def run_script(body: str, *args: str) -> dict:
    script = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_runtime_torch_uses_is_found():
    out = run_script("print(json.dumps({'found': openmp.runtime() is not None}))")
    assert out["found"], "no libgomp/libomp mapped: torch's CPU build changed its runtime"


def test_a_serial_thread_runs_torch_ops_without_a_team_of_its_own():
    out = run_script("""
        seen = {}
        def helper():
            openmp.serial_thread()
            seen["torch_threads"] = torch.get_num_threads()
            before = threads()
            (big * 2).sum(); torch.randn(512, 512) @ torch.randn(512, 512)
            seen["new_threads"] = threads() - before
        t = threading.Thread(target=helper); t.start(); t.join()
        seen["main_torch_threads"] = torch.get_num_threads()
        print(json.dumps(seen))
    """)
    assert out == {"torch_threads": 1, "new_threads": 0, "main_torch_threads": 2}


def test_release_team_lets_this_threads_idle_workers_go():
    out = run_script("""
        before = threads()
        (big * 2).sum()
        with_team = threads()
        openmp.release_team()
        released = threads()
        (big * 2).sum()
        print(json.dumps({"team": with_team - before, "after_release": released - before,
                          "runs_again": threads() - before}))
    """)
    assert out == {"team": 1, "after_release": 0, "runs_again": 1}


def test_the_step_thread_does_not_sleep_at_barriers_after_image_requests(tiny_qwen2_vl):
    """The symptom: before engine/openmp.py, the engine built on one thread and images
    preprocessed on others left three teams for two CPUs, and the step thread slept at every
    parallel region's barrier (12 times a decode step with this checkpoint, 24 with the bench
    one) instead of a few times a request."""
    out = run_script(
        """
        import asyncio
        from engine import AsyncEngine, SamplingParams
        from engine.config import EngineArgs
        from PIL import Image
        def voluntary_switches(tid):
            for line in open(f"/proc/self/task/{tid}/status"):
                if line.startswith("voluntary_ctxt_switches"):
                    return int(line.split()[1])
        async def main():
            eng = AsyncEngine(EngineArgs(model=sys.argv[1], device="cpu"))
            n = iter(range(100))
            async def run(prompt, tokens, priority="interactive"):
                params = SamplingParams(max_tokens=tokens, ignore_eos=True)
                stream = await eng.add_request(f"r{next(n)}", prompt, params, priority=priority)
                async for _ in stream:
                    pass
            def image(shade):
                return {"prompt": "<|vision_start|><|image_pad|><|vision_end|>who?",
                        "multi_modal_data": {"image": Image.new("RGB", (224, 160), shade)}}
            await run(image((200, 30, 30)), 2)
            await run(image((30, 200, 30)), 2, "batch")
            tid = eng._thread.native_id
            before = voluntary_switches(tid)
            await run("Tell me about cats", 64)
            print(json.dumps({"per_step": (voluntary_switches(tid) - before) / 64}))
            eng.shutdown()
        asyncio.run(main())
        """,
        str(tiny_qwen2_vl),
    )
    assert out["per_step"] < 1.0


def test_serial_thread_never_breaks_the_pool_it_initialises(monkeypatch, caplog):
    """A runtime that fails (a double: the fault is injected) costs a warning, not a pool
    whose every later job fails with BrokenThreadPool."""
    from concurrent.futures import ThreadPoolExecutor

    from engine import openmp

    class FailingRuntime:
        def omp_set_num_threads(self, n: int) -> None:
            raise OSError("injected")

    monkeypatch.setattr(openmp, "runtime", lambda: FailingRuntime())
    with ThreadPoolExecutor(max_workers=1, initializer=openmp.serial_thread) as pool:
        assert pool.submit(lambda: 42).result(timeout=30) == 42
    assert "could not make this thread's torch ops serial" in caplog.text
