"""Mixed serving benchmark: interactive chat streams + camera frames, over HTTP, per mode.

For each mode a server is started on the same checkpoint and dtype, then driven with streaming
chat completions (``--client raw``, the default: the stream read off the socket, so the load
generator takes little of the cores it shares with the server; ``--client openai``: the SDK):

* phase "alone": K chat streams, nothing else — the ITL baseline (decode steps, no prefill),
  for ``--alone-min-s`` at least (its tail is compared with a mixed phase of minutes);
* phase "mixed": the same chat streams plus camera requests (one frame, ``priority=batch``,
  short answer) arriving as a seeded Poisson process at ``--camera-rate`` req/s (``inf``: all
  at t=0).

Modes: ``default`` (no step flags: steps sized by predicted time; ``default@F``: with
``--auto-itl-factor F``),
``chunked-N`` (budget N), ``unchunked`` (whole prompt in one step), ``adaptive-X``
(``--target-itl-ms X``, ``auto`` allowed), any of those with ``+wholeenc`` (image encoding
not split across steps, as in vLLM/SGLang) or ``+int8`` (``--quantization int8``), ``hf`` /
``hf-cb`` (``transformers serve`` without / with ``--continuous-batching``; sent plain OpenAI
requests). Metric definitions
follow shared/DESIGN.md (TTFT, ITL, TPOT, stall = ITL > 5x the median alone-phase ITL).

    python -m benchmarks.serve_mixed                       # CPU-sized default (< 10 min)
    python -m benchmarks.serve_mixed --modes chunked-512,unchunked --camera-rate 0.5 \
        --capacity-rates 0.1,0.2,0.4 --slo-itl-ms 150 --slo-ttft-ms 3000
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import itertools
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import RESULTS, bench_checkpoint, camera_frame, log, save_json, setup_env
from benchmarks.sse_client import RawChatClient

CHAT_PROMPTS = [
    "Tell me about the history of the city tram.",
    "What should I pack for a weekend hike?",
    "Explain how a camera sensor works.",
    "Write a short poem about the harbour at night.",
    "How do I make a good cup of coffee?",
    "Summarise the plot of a detective story.",
]


@dataclass
class RequestRecord:
    kind: str  # "chat" | "camera"
    stream: int
    arrival: float  # seconds since phase start
    ttft: float | None = None
    e2e: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds since phase start
    output_tokens: int = 0
    error: str | None = None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


# ---- servers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(mode: str, model: Path, port: int, args) -> tuple[list[str], bool]:
    """(argv, is_ours)."""
    if mode in ("hf", "hf-cb"):
        # the CLI installed beside this interpreter: the venv need not be on PATH
        beside = Path(sys.executable).with_name("transformers")
        cmd = [
            str(beside) if beside.exists() else "transformers",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            "--device",
            "cpu" if args.device == "cpu" else "auto",
        ]
        if mode == "hf-cb":
            cmd.append("--continuous-batching")
        return cmd, False
    mode, _, variant = mode.partition("+")
    cmd = [
        sys.executable,
        "-m",
        "vision_serve.cli",
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        "64",
    ]
    if mode == "default" or mode.startswith("default@"):
        # the server's own defaults: steps sized by predicted time; default@F: the auto ITL
        # target at F x the decode step instead of the default factor
        if "@" in mode:
            cmd += ["--auto-itl-factor", mode.partition("@")[2]]
    elif mode == "unchunked":
        cmd += ["--no-chunked-prefill", "--max-num-batched-tokens", "8192"]
    elif mode.startswith("chunked-"):
        cmd += ["--max-num-batched-tokens", mode.split("-", 1)[1]]
    elif mode.startswith("adaptive-"):
        target, _, factor = mode.split("-", 1)[1].partition("@")  # adaptive-auto@2: factor 2
        cmd += [
            "--max-num-batched-tokens",
            str(args.adaptive_max_budget),
            "--target-itl-ms",
            target,
        ]
        if factor:
            cmd += ["--auto-itl-factor", factor]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if variant == "wholeenc":  # the vision encoder runs a whole image inside one step
        cmd.append("--no-enable-chunked-encoder")
    elif variant == "int8":  # weight-only int8 decoder linears
        cmd += ["--quantization", "int8"]
    elif variant:
        raise SystemExit(f"unknown mode variant {variant!r}")
    return cmd + shlex.split(getattr(args, "server_args", "")), True


@contextmanager
def running_server(cmd: list[str], port: int, timeout: float = 300.0):
    log(f"starting: {' '.join(cmd)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    logf = open(RESULTS / f"server-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {logf.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("server did not become healthy")
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        logf.close()


# ---- workload -----------------------------------------------------------------------------------
def frame_data_url(width: int, height: int, seed: int) -> str:
    buf = io.BytesIO()
    camera_frame(width, height, seed=seed).save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


CLIENTS = ("raw", "openai")


def make_client(kind: str, base_url: str, timeout: float):
    """The load generator's client: ``raw`` (benchmarks/sse_client.py: the stream read off the
    socket, ~80 µs of CPU a token) or ``openai`` (the SDK, ~350 µs a token on the same cores)."""
    if kind == "raw":
        return RawChatClient(base_url, "bench", timeout)
    if kind == "openai":
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=base_url, api_key="bench", timeout=timeout, max_retries=0)
    raise ValueError(f"unknown client {kind!r}; one of {CLIENTS}")


def add_client_argument(ap) -> None:
    """``--client`` of every serving benchmark (the load generator's client, see make_client)."""
    ap.add_argument(
        "--client",
        choices=CLIENTS,
        default="raw",
        help="the load generator's client: raw (benchmarks/sse_client.py says why) or openai",
    )


async def openai_content_events(client, model, messages, max_tokens, extra):
    """The streamed completion's non-empty content deltas through the ``openai`` SDK (``--client
    openai``), as ``RawChatClient.content_events`` yields them off the socket."""
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=extra or None,
    )
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta and delta.content:
            yield delta.content


async def one_request(client, model, messages, max_tokens, extra, rec: RequestRecord, t0: float):
    """Stream one chat completion, recording when each content event arrived."""
    try:
        if isinstance(client, RawChatClient):
            events = client.content_events(model, messages, max_tokens, extra)
        else:
            events = openai_content_events(client, model, messages, max_tokens, extra)
        async for _ in events:
            now = time.monotonic() - t0
            if rec.ttft is None:
                rec.ttft = now - rec.arrival
            rec.token_times.append(now)
            rec.output_tokens += 1
        rec.e2e = time.monotonic() - t0 - rec.arrival
    except Exception as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


async def run_phase(
    base_url: str,
    model: str,
    ours: bool,
    args,
    camera_rate: float | None,
    num_cameras: int,
    rng_seed: int,
) -> list[RequestRecord]:
    client = make_client(args.client, base_url, timeout=600)
    rng = random.Random(rng_seed)
    records: list[RequestRecord] = []
    t0 = time.monotonic()
    chat_extra = {"ignore_eos": True} if ours else {}
    cam_extra = {"priority": "batch", "ignore_eos": True} if ours else {}
    stop_chat = asyncio.Event()

    async def chat_stream(i: int):
        n = 0
        while not stop_chat.is_set():
            rec = RequestRecord("chat", i, time.monotonic() - t0)
            records.append(rec)
            tokens = rng.randint(args.chat_min_tokens, args.chat_max_tokens)
            msgs = [{"role": "user", "content": CHAT_PROMPTS[(i + n) % len(CHAT_PROMPTS)]}]
            await one_request(client, model, msgs, tokens, chat_extra, rec, t0)
            n += 1
            # the baseline's tail must come from as long a stretch as the mixed phase's (a
            # few seconds of samples against minutes with frames compared a p99 of 380 gaps
            # with one of 39,000)
            alone_done = n >= args.alone_requests and time.monotonic() - t0 >= args.alone_min_s
            if camera_rate is None and alone_done:
                return

    async def cameras():
        tasks = []
        delay = 0.0
        for j in range(num_cameras):
            if camera_rate not in (None, float("inf")):
                delay += rng.expovariate(camera_rate)
                await asyncio.sleep(max(0.0, delay - (time.monotonic() - t0)))
            rec = RequestRecord("camera", j, time.monotonic() - t0)
            records.append(rec)
            msgs = [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": frames[j % len(frames)]}},
                        {"type": "text", "text": f"Camera {j}: who is in view?"},
                    ],
                }
            ]
            tasks.append(
                asyncio.create_task(
                    one_request(client, model, msgs, args.camera_tokens, cam_extra, rec, t0)
                )
            )
        await asyncio.gather(*tasks)
        stop_chat.set()

    w, h = (int(x) for x in args.image_size.split("x"))
    frames = [frame_data_url(w, h, seed=rng_seed * 100 + k) for k in range(max(1, num_cameras))]
    chats = [asyncio.create_task(chat_stream(i)) for i in range(args.num_chat)]
    if camera_rate is not None:
        await asyncio.sleep(args.warmup_s)  # let chat streams reach steady decoding first
        await cameras()
    await asyncio.gather(*chats)
    await client.close()
    return records


# ---- metrics ------------------------------------------------------------------------------------
def scrape_step_buckets(port: int) -> dict[str, float]:
    """Our /metrics step-duration histogram: cumulative count per bucket bound."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("vision_serve_step_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[bound] = float(line.rsplit(" ", 1)[1])
    return out


def longest_step_bound(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Upper bound of the longest step between two scrapes: the smallest bucket bound that
    holds every step taken meanwhile."""
    if not after:
        return None
    total = after.get("+Inf", 0) - before.get("+Inf", 0)
    for bound in sorted((b for b in after if b != "+Inf"), key=float):
        if after[bound] - before.get(bound, 0) >= total:
            return float(bound)
    return float("inf")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarise(records: list[RequestRecord], alone_median_itl: float | None) -> dict:
    out: dict = {}
    span = max((r.arrival + (r.e2e or 0) for r in records), default=0) or 1e-9
    for kind in ("chat", "camera"):
        rs = [r for r in records if r.kind == kind]
        ok = [r for r in rs if r.error is None and r.ttft is not None]
        ttft = [r.ttft for r in ok]
        itl = [g for r in ok for g in r.itls]
        tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        stall_at = 5 * alone_median_itl if alone_median_itl else None
        out[kind] = {
            "requests": len(rs),
            "errors": len(rs) - len(ok),
            "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99),
            "ttft_max": max(ttft, default=None),
            "itl_p50": pct(itl, 50),
            "itl_p99": pct(itl, 99),
            "itl_max": max(itl, default=None),
            "tpot_p50": pct(tpot, 50),
            "tpot_p99": pct(tpot, 99),
            "stalls": sum(1 for g in itl if stall_at and g > stall_at),
            "output_tokens": sum(r.output_tokens for r in ok),
        }
    out["output_tok_s"] = sum(out[k]["output_tokens"] for k in ("chat", "camera")) / span
    out["requests_s"] = sum(1 for r in records if r.error is None) / span
    out["span_s"] = span
    return out


def meets_slo(summary: dict, args, slo_itl_ms: float, itl_stat: str = "itl_p99") -> bool:
    """DESIGN.md's capacity test (``itl_stat="itl_p99"``), or its stall-free variant
    (``"itl_max"``): a p99 over thousands of chat tokens hides a few multi-second stalls when
    frames are rare, so the max shows what a user of the stream actually sees."""
    chat = summary["chat"]
    return (
        chat[itl_stat] is not None
        and chat[itl_stat] * 1e3 <= slo_itl_ms
        and chat["ttft_p50"] is not None
        and chat["ttft_p50"] * 1e3 <= args.slo_ttft_ms
        and summary["camera"]["errors"] == 0
        # frames must keep up too: a mode that meets the chat SLO by starving them has no
        # capacity for them (camera TTFT grows without bound once the rate is too high)
        and (
            summary["camera"]["ttft_p50"] is None
            or summary["camera"]["ttft_p50"] <= args.slo_camera_ttft_s
        )
    )


# ---- plots --------------------------------------------------------------------------------------
def plot(results: dict, path_prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    modes = list(results)
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 2.2 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        recs = results[mode]["mixed_records"]
        for r in recs:
            if r["kind"] == "chat" and len(r["token_times"]) > 1:
                t = r["token_times"]
                ax.plot(t[1:], [1e3 * (b - a) for a, b in itertools.pairwise(t)], lw=0.6)
        for r in recs:
            if r["kind"] == "camera":
                ax.axvline(r["arrival"], color="k", alpha=0.25, lw=0.8)
        ax.set_title(f"{mode}: chat ITL (ms) over time; grey lines = camera arrivals", fontsize=9)
        ax.set_yscale("log")
    fig.tight_layout()
    p = path_prefix.with_name(path_prefix.name + "_itl_timeline.png")
    fig.savefig(p, dpi=110)
    paths.append(p)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        itl = sorted(
            1e3 * g
            for r in results[mode]["mixed_records"]
            if r["kind"] == "chat"
            for g in RequestRecord(**r).itls
        )
        if itl:
            ax.plot(itl, [i / len(itl) for i in range(len(itl))], label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("chat ITL (ms)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    p = path_prefix.with_name(path_prefix.name + "_itl_cdf.png")
    fig.savefig(p, dpi=110)
    paths.append(p)
    plt.close(fig)

    caps = {m: results[m].get("capacity_req_s") for m in modes if "capacity_req_s" in results[m]}
    if caps:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(list(caps), [c or 0 for c in caps.values()])
        ax.set_ylabel("camera req/s within SLO")
        p = path_prefix.with_name(path_prefix.name + "_capacity.png")
        fig.savefig(p, dpi=110)
        paths.append(p)
        plt.close(fig)
    return paths


# ---- main ---------------------------------------------------------------------------------------
def run_mode(mode: str, model: Path, args) -> dict:
    port = free_port()
    cmd, ours = server_command(mode, model, port, args)
    served = "bench" if ours else str(model)
    base = f"http://127.0.0.1:{port}/v1"
    with running_server(cmd, port):
        # warm-up: one chat and one frame (first-call allocations, thread pools)
        asyncio.run(run_phase(base, served, ours, _warm(args), 1.0, 1, rng_seed=999))
        alone = asyncio.run(run_phase(base, served, ours, args, None, 0, rng_seed=args.seed))
        alone_itl = [g for r in alone for g in r.itls]
        median_itl = statistics.median(alone_itl) if alone_itl else None
        steps_before = scrape_step_buckets(port) if ours else {}
        mixed = asyncio.run(
            run_phase(base, served, ours, args, args.camera_rate, args.num_cameras, args.seed + 1)
        )
        result = {
            "max_step_s": longest_step_bound(steps_before, scrape_step_buckets(port)),
            "command": cmd,
            "alone": summarise(alone, median_itl),
            "mixed": summarise(mixed, median_itl),
            "mixed_records": [asdict(r) for r in mixed],
            "alone_median_itl": median_itl,
        }
        if args.capacity_rates:
            best = dict.fromkeys(args.slo_itl_ms, 0.0)
            stall_free = dict.fromkeys(args.slo_itl_ms, 0.0)
            for i, rate in enumerate(args.capacity_rates):
                # fresh frames per rate: a frame seen before is a prefix/encoder-cache hit
                seed = args.seed + 7 + 1000 * i
                recs = asyncio.run(
                    run_phase(base, served, ours, args, rate, args.capacity_cameras, seed)
                )
                s = summarise(recs, median_itl)
                result.setdefault("capacity_runs", {})[str(rate)] = s
                c = s["chat"]
                log(f"{mode} rate {rate}: chat itl p99 {c['itl_p99']} ttft p50 {c['ttft_p50']}")
                for slo in args.slo_itl_ms:
                    if meets_slo(s, args, slo):
                        best[slo] = max(best[slo], rate)
                    if meets_slo(s, args, slo, "itl_max"):
                        stall_free[slo] = max(stall_free[slo], rate)
            # the first SLO is the headline; the others come from the same runs
            result["capacity_req_s"] = best[args.slo_itl_ms[0]]
            result["capacity_by_slo_itl_ms"] = {str(k): v for k, v in best.items()}
            result["stall_free_capacity_by_slo_itl_ms"] = {str(k): v for k, v in stall_free.items()}
    return result


def _warm(args):
    w = argparse.Namespace(**vars(args))
    w.num_chat, w.chat_min_tokens, w.chat_max_tokens, w.warmup_s = 1, 4, 4, 0.0
    w.alone_min_s = 0.0
    return w


def fmt(v, scale=1e3, f=".0f"):
    return "-" if v is None else format(v * scale, f)


def print_table(results: dict) -> None:
    cols = [
        "mode",
        "chat ITL p50/p99/max ms",
        "alone p99",
        "stalls",
        "chat TTFT p50 s",
        "cam TTFT p50/p99 s",
        "tok/s",
        "longest step <= ms",
    ]
    print("\n" + " | ".join(cols))
    for mode, r in results.items():
        c, k = r["mixed"]["chat"], r["mixed"]["camera"]
        print(
            " | ".join(
                [
                    mode,
                    f"{fmt(c['itl_p50'])}/{fmt(c['itl_p99'])}/{fmt(c['itl_max'])}",
                    fmt(r["alone"]["chat"]["itl_p99"]),
                    str(c["stalls"]),
                    fmt(c["ttft_p50"], 1, ".2f"),
                    f"{fmt(k['ttft_p50'], 1, '.2f')}/{fmt(k['ttft_p99'], 1, '.2f')}",
                    f"{r['mixed']['output_tok_s']:.1f}",
                    fmt(r.get("max_step_s")),
                ]
            )
        )


def print_capacity(results: dict) -> None:
    rows = {m: r for m, r in results.items() if "capacity_by_slo_itl_ms" in r}
    if not rows:
        return
    slos = list(next(iter(rows.values()))["capacity_by_slo_itl_ms"])
    heads = [f"p99 ITL <= {float(s):.0f} ms" for s in slos]
    heads += [f"max ITL <= {float(s):.0f} ms" for s in slos]
    print("\ncapacity (camera req/s) | " + " | ".join(heads))
    for mode, r in rows.items():
        caps = [r["capacity_by_slo_itl_ms"][s] for s in slos]
        caps += [r["stall_free_capacity_by_slo_itl_ms"][s] for s in slos]
        print(" | ".join([mode, *(f"{c:g}" for c in caps)]))


def ratios(results: dict) -> dict:
    def get(mode, *path):
        r = results.get(mode)
        for p in path:
            r = None if r is None else r.get(p)
        return r

    chunked = [m for m in results if m.startswith(("chunked", "adaptive"))]
    best = min(chunked, key=lambda m: get(m, "mixed", "chat", "itl_p99") or 1e9, default=None)
    out = {"best_chunked_mode": best}
    if best and "unchunked" in results:
        for q in ("itl_max", "itl_p99"):
            a, b = get("unchunked", "mixed", "chat", q), get(best, "mixed", "chat", q)
            out[f"chat_{q}_off_over_chunked"] = a / b if a and b else None
        capped = [m for m in chunked if get(m, "capacity_req_s") is not None]
        if capped:
            top = max(capped, key=lambda m: get(m, "capacity_req_s"))
            a, b = get(top, "capacity_req_s"), get("unchunked", "capacity_req_s")
            out["best_capacity_mode"] = top
            # off has no capacity at all (0) when it never meets the SLO: the ratio is inf
            out["capacity_chunked_over_off"] = (a / b) if b else (float("inf") if a else None)

            def stall_free(m):
                caps = get(m, "stall_free_capacity_by_slo_itl_ms") or {}
                return next(iter(caps.values()), None)

            a, b = max(stall_free(m) or 0 for m in capped), stall_free("unchunked")
            out["stall_free_capacity_chunked_over_off"] = (
                (a / b) if b else (float("inf") if a else None)
            )
    for peer in ("hf", "hf-cb"):
        if best and peer in results:
            a, b = get(best, "mixed", "output_tok_s"), get(peer, "mixed", "output_tok_s")
            out[f"throughput_ours_over_{peer}"] = a / b if a and b else None
    if best:
        a, b = get(best, "mixed", "chat", "itl_p99"), get(best, "alone", "chat", "itl_p99")
        out["chat_p99_mixed_over_alone"] = a / b if a and b else None
    return out


def main() -> None:
    setup_env()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model")
    ap.add_argument("--family", default="qwen2_vl")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--modes",
        default="chunked-256,chunked-512,chunked-2048,unchunked,adaptive-auto,"
        "adaptive-auto+wholeenc,chunked-512+wholeenc,hf,hf-cb",
    )
    ap.add_argument("--num-chat", type=int, default=4)
    add_client_argument(ap)
    ap.add_argument("--chat-min-tokens", type=int, default=64)
    ap.add_argument("--chat-max-tokens", type=int, default=128)
    ap.add_argument(
        "--alone-requests", type=int, default=1, help="chat requests per stream, alone phase"
    )
    ap.add_argument(
        "--alone-min-s",
        type=float,
        default=60.0,
        help="the alone phase lasts at least this long (more requests per stream)",
    )
    ap.add_argument("--camera-rate", type=float, default=0.5, help="req/s; inf = all at t=0")
    ap.add_argument("--num-cameras", type=int, default=6)
    ap.add_argument("--camera-tokens", type=int, default=16)
    ap.add_argument("--image-size", default="640x480")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--adaptive-max-budget", type=int, default=2048)
    ap.add_argument("--capacity-rates", default="", help="comma-separated camera rates to search")
    ap.add_argument("--capacity-cameras", type=int, default=6)
    ap.add_argument(
        "--slo-itl-ms",
        default="200",
        help="chat p99 ITL SLO; several (comma-separated) are scored from the same runs",
    )
    ap.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    ap.add_argument(
        "--slo-camera-ttft-s",
        type=float,
        default=20.0,
        help="capacity also needs camera TTFT p50 under this: frames must keep up",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        default="serve_mixed",
        help="results name (under results/) or path; .json and the plots get their suffixes",
    )
    ap.add_argument(
        "--server-args",
        default="",
        help="more flags for our server in every mode, e.g. '--step-trace results/steps.jsonl'",
    )
    args = ap.parse_args()
    args.capacity_rates = [float(x) for x in args.capacity_rates.split(",") if x]
    args.slo_itl_ms = [float(x) for x in str(args.slo_itl_ms).split(",") if x]
    RESULTS.mkdir(exist_ok=True)
    model = bench_checkpoint(args.family, args.model)
    results = {}
    for mode in [m for m in args.modes.split(",") if m]:
        log(f"mode {mode}")
        try:
            results[mode] = run_mode(mode, model, args)
        except Exception as exc:
            log(f"mode {mode} failed: {exc}")
            results[mode] = {"error": str(exc)}
    ok = {m: r for m, r in results.items() if "error" not in r}
    print_table(ok)
    print_capacity(ok)
    summary = {"args": vars(args), "ratios": ratios(ok), "modes": results}
    print(
        "\nratios:",
        {k: (round(v, 2) if isinstance(v, float) else v) for k, v in summary["ratios"].items()},
    )
    stem = Path(args.out.removesuffix(".json"))
    stem = stem if stem.parent != Path(".") else RESULTS / stem
    save_json(f"{stem}.json", summary)
    if ok:
        for p in plot(ok, stem):
            log(f"saved {p}")


if __name__ == "__main__":
    main()
