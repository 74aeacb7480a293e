"""The server's CPU per streamed token, thread by thread: what the front end takes from the engine.

On a 2-core edge box the HTTP front end (the event loop on the server's main thread: SSE
chunks, socket writes, the engine's wake-ups) and the clients run on the cores the engine
steps on, so every microsecond they spend per token is one the camera work does not get
(issue 14's "camera work gets all that chat leaves"). This starts ``vision-serve serve`` with
default flags, runs ``--num-chat`` chat streams back to back (``--client raw``: the stream
read off the socket, as the other serving benchmarks now do; ``--client openai``: the SDK),
and after a warm-up reads each server thread's CPU time (``/proc/<pid>/task/*/stat``) over
``--seconds``: the main thread (the event loop), the step thread and its OpenMP worker (the two
busiest others), and the client process's own CPU.

    python -m benchmarks.front_end_cpu [--num-chat 4] [--seconds 30] [--client raw|openai]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time

from benchmarks.common import bench_checkpoint, log, save_json, setup_env
from benchmarks.serve_mixed import (
    CHAT_PROMPTS,
    RequestRecord,
    add_client_argument,
    free_port,
    make_client,
    one_request,
    running_server,
)


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


async def measure(port: int, pid: int, args) -> dict:
    client = make_client(args.client, f"http://127.0.0.1:{port}/v1", timeout=600)
    records: list[RequestRecord] = []
    stop = asyncio.Event()
    t0 = time.monotonic()

    async def chat(i: int) -> None:
        n = 0
        while not stop.is_set():
            rec = RequestRecord("chat", i, time.monotonic() - t0)
            records.append(rec)
            prompt = CHAT_PROMPTS[(i + n) % len(CHAT_PROMPTS)]
            messages = [{"role": "user", "content": prompt}]
            extra = {"ignore_eos": True}
            await one_request(client, "bench", messages, args.max_tokens, extra, rec, t0)
            n += 1

    streams = [asyncio.create_task(chat(i)) for i in range(args.num_chat)]
    await asyncio.sleep(args.warmup)

    def snapshot():
        own = os.times()
        tokens = sum(len(r.token_times) for r in records)
        return thread_cpu_s(pid), own.user + own.system, tokens, time.monotonic()

    cpu0, own0, tokens0, wall0 = snapshot()
    await asyncio.sleep(args.seconds)
    cpu1, own1, tokens1, wall1 = snapshot()
    stop.set()
    await asyncio.gather(*streams, return_exceptions=True)
    errors = [r.error for r in records if r.error]
    tokens = tokens1 - tokens0
    if tokens == 0:
        raise SystemExit(f"no token streamed in {args.seconds} s; errors: {errors[:3]}")
    used = {tid: cpu1[tid] - cpu0.get(tid, 0.0) for tid in cpu1}
    main = used.pop(pid, 0.0)
    busiest = sorted(used.values(), reverse=True)
    per_token = 1e6 / tokens
    result = {
        "tokens": tokens,
        "seconds": wall1 - wall0,
        "tokens_per_s": tokens / (wall1 - wall0),
        "event_loop_us_per_token": main * per_token,
        "event_loop_core_share": main / (wall1 - wall0),
        "step_threads_us_per_token": sum(busiest[:2]) * per_token,
        "other_threads_us_per_token": sum(busiest[2:]) * per_token,
        "client_us_per_token": (own1 - own0) * per_token,
        "client_core_share": (own1 - own0) / (wall1 - wall0),
        "errors": len(errors),
    }
    itl = sorted(b - a for r in records for a, b in itertools.pairwise(r.token_times))
    if itl:
        result["itl_p50_ms"] = 1e3 * itl[len(itl) // 2]
        result["itl_p99_ms"] = 1e3 * itl[int(0.99 * (len(itl) - 1))]
    return result


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bench one)")
    ap.add_argument("--num-chat", type=int, default=4)
    add_client_argument(ap)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--out", default="front_end_cpu.json")
    args = ap.parse_args()
    model = bench_checkpoint(path=args.model)
    port = free_port()
    cmd = [sys.executable, "-m", "vision_serve.cli", "serve", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench"]
    with running_server(cmd, port) as proc:
        result = asyncio.run(measure(port, proc.pid, args))
    log(
        f"{result['tokens']} tokens in {result['seconds']:.1f} s "
        f"({result['tokens_per_s']:.0f}/s), chat ITL p50 {result.get('itl_p50_ms', 0):.1f} ms"
    )
    log(
        f"CPU per streamed token: event loop {result['event_loop_us_per_token']:.0f} us "
        f"({100 * result['event_loop_core_share']:.1f} % of a core), step threads "
        f"{result['step_threads_us_per_token']:.0f} us, other server threads "
        f"{result['other_threads_us_per_token']:.0f} us, client "
        f"{result['client_us_per_token']:.0f} us ({100 * result['client_core_share']:.1f} % of "
        "a core)"
    )
    save_json(args.out, {"args": vars(args), **result})


if __name__ == "__main__":
    main()
