"""``vision-serve chat``: talk to a checkpoint from the terminal, streaming tokens as they come.

With ``--prompt`` it answers once and exits (scriptable demo); without, it reads lines from
stdin as a conversation. ``--image`` attaches a picture (path) to the first user turn.
"""

from __future__ import annotations

import argparse
import sys
import time

from engine.config import add_engine_cli_args, engine_args_from_namespace


def add_chat_cli(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with a checkpoint from the command line")
    add_engine_cli_args(p)
    p.add_argument("--prompt", help="answer this one message and exit")
    p.add_argument("--image", action="append", default=[], help="image file for the first turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=run_chat)


def _turn(text: str, images: list[str]) -> dict:
    if not images:
        return {"role": "user", "content": text}
    parts = [{"type": "image_url", "image_url": {"url": path}} for path in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def run_chat(args: argparse.Namespace) -> int:
    from engine.errors import InvalidRequestError
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    if not args.model:
        print("chat: --model DIR is required", file=sys.stderr)
        return 2
    print(f"chat: loading {args.model} ...", file=sys.stderr)
    engine = LLMEngine(engine_args_from_namespace(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    history: list[dict] = []
    images = list(args.image)
    lines = [args.prompt] if args.prompt is not None else (line.rstrip("\n") for line in sys.stdin)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        history.append(_turn(line, images))
        images = []
        try:
            engine.add_request(f"chat-{i}", history, params)
        except InvalidRequestError as exc:
            print(f"chat: error: {exc}", file=sys.stderr)
            history.pop()
            continue
        start, first, reply, n = time.perf_counter(), None, "", 0
        while engine.has_unfinished():
            for out in engine.step():
                delta = out.outputs[0].delta_text
                if delta and first is None:
                    first = time.perf_counter() - start
                reply += delta
                n = len(out.outputs[0].token_ids)
                sys.stdout.write(delta)
                sys.stdout.flush()
        total = time.perf_counter() - start
        print(
            f"\n[chat] tokens={n} ttft_s={first or total:.3f} total_s={total:.3f}",
            file=sys.stderr,
        )
        history.append({"role": "assistant", "content": reply})
    return 0
