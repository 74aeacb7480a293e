"""Structured output: per-step token-mask cost of xgrammar vs llguidance, and decode throughput
with and without a JSON-schema constraint (issue 17).

Mask cost is measured on a Qwen2-sized vocabulary: a *synthetic* byte-level BPE vocabulary of
151,643 regular tokens (the 256 byte symbols, then JSON punctuation runs, digits and invented
words in the GPT-2 byte-level alphabet, ``Ġ``-prefixed like Qwen's) plus Qwen2's 22 added
tokens, padded to 151,936 rows as Qwen2's ``config.vocab_size``. No tokenizer is downloaded; the
grammar libraries only need the vocabulary's byte strings. Each step fills the bitmask of every
row of the batch (each row its own matcher, at a different point of the same schema) and
advances each matcher by one allowed token; the figure is wall time per step for the whole
batch, compile time excluded (reported separately).

Throughput runs the ``bench`` checkpoint through the engine: ``max_tokens`` decode tokens for
batch 1/8/16, unconstrained vs the schema (the engine's chosen library).

    python -m benchmarks.structured_output                   # both parts, ~2-3 min on 2 cores
    python -m benchmarks.structured_output --skip-engine     # mask cost only
    python -m benchmarks.structured_output --model DIR --max-tokens 4 --batches 1 --steps 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from benchmarks.common import bench_checkpoint, log, save_json

QWEN2_REGULAR_TOKENS = 151_643
QWEN2_CONFIG_VOCAB = 151_936
QWEN2_ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    *[f"<|extra_{i}|>" for i in range(11)],
    "<tool_call>",
    "</tool_call>",
    *[f"<|fim_{i}|>" for i in range(6)],
]

# A person / activity / threat report, the shape a camera describer asks for.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "people": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "clothing": {"type": "string", "maxLength": 60},
                    "activity": {
                        "type": "string",
                        "enum": ["walking", "standing", "running", "loitering", "delivering"],
                    },
                    "carrying": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["clothing", "activity", "carrying"],
                "additionalProperties": False,
            },
        },
        "vehicle_present": {"type": "boolean"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "potential_threat_level": {"type": "integer", "minimum": 0, "maximum": 2},
    },
    "required": ["title", "people", "vehicle_present", "confidence", "potential_threat_level"],
    "additionalProperties": False,
}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable-character map, in byte order (what ``Ġ`` and ``Ċ`` come from)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def synthetic_vocab(seed: int = 0) -> list[str]:
    """151,643 distinct byte-level token strings, Qwen2-like in make-up (see the docstring)."""
    rng = random.Random(seed)
    alphabet = _byte_alphabet()
    space = alphabet[ord(" ")]
    newline = alphabet[ord("\n")]
    vocab: list[str] = list(alphabet)
    seen = set(vocab)

    def add(tok: str) -> None:
        if tok not in seen:
            seen.add(tok)
            vocab.append(tok)

    punct = ['"', "{", "}", "[", "]", ":", ",", " ", "\\", ".", "-", "_"]
    for a in punct:  # JSON punctuation runs: '",', '":', '{"', ' "', '},{"' ...
        for b in punct:
            add((a + b).replace(" ", space))
            for c in punct:
                add((a + b + c).replace(" ", space))
    for i in range(1000):
        add(str(i))
    for k in range(1, 9):
        add(space * k)
        add(newline * min(k, 3) + space * k)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    while len(vocab) < QWEN2_REGULAR_TOKENS:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 11)))
        add(rng.choice(["", space, space, '"', space + '"']) + word)
    return vocab[:QWEN2_REGULAR_TOKENS]


class _XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[str], eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType.BYTE_LEVEL,
            vocab_size=QWEN2_CONFIG_VOCAB,
            stop_token_ids=[eos],
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, QWEN2_CONFIG_VOCAB)

    def fill(self, matchers, mask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
            return
        if not hasattr(self, "_batch"):
            self._batch = self.xgr.BatchGrammarMatcher(max_threads=2)
        self._batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class _LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: list[str], eos: int) -> None:
        import llguidance
        import llguidance.torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.llg = llguidance
        ids = {tok: i for i, tok in enumerate(vocab)}
        for i, tok in enumerate(QWEN2_ADDED):
            ids[tok] = QWEN2_REGULAR_TOKENS + i
        bpe = models.BPE(vocab=ids, merges=[])
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        from llguidance.hf import from_tokenizer
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
        fast.add_special_tokens({"additional_special_tokens": QWEN2_ADDED[1:]})
        self.tokenizer = from_tokenizer(fast, n_vocab=QWEN2_CONFIG_VOCAB, eos_token=eos)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        err = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise ValueError(err)
        return grammar

    def matchers(self, compiled, n: int):
        return [self.llg.LLMatcher(self.tokenizer, compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask

        return allocate_token_bitmask(n, QWEN2_CONFIG_VOCAB)

    def fill(self, matchers, mask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(
            self._executor(), [(m, i) for i, m in enumerate(matchers)], mask
        )

    def _executor(self):
        if not hasattr(self, "_exec"):
            self._exec = self.llg.LLExecutor()
        return self._exec

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


def _allowed(mask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids whose bit is set in one packed int32 bitmask row."""
    bits = (mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()[:vocab_size]).flatten()


def mask_cost(lib, batch: int, steps: int, seed: int) -> dict:
    t0 = time.perf_counter()
    compiled = lib.compile(SCHEMA)
    compile_s = time.perf_counter() - t0
    matchers = lib.matchers(compiled, batch)
    mask = lib.bitmask(batch)
    rng = random.Random(seed)
    # stagger the rows so the batch is at different points of the schema, as in serving
    for k, m in enumerate(matchers):
        for _ in range(k % 7):
            lib.fill([m], mask[:1])
            ids = _allowed(mask[0], QWEN2_CONFIG_VOCAB)
            lib.accept(m, int(ids[rng.randrange(len(ids))]))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        lib.fill(matchers, mask)
        times.append(time.perf_counter() - t)
        for i, m in enumerate(matchers):
            ids = _allowed(mask[i], QWEN2_CONFIG_VOCAB)
            ids = ids[ids < QWEN2_REGULAR_TOKENS] if len(ids) > 1 else ids
            token = int(ids[rng.randrange(len(ids))])
            if not lib.accept(m, token) or lib.done(m):
                matchers[i] = lib.matchers(compiled, 1)[0]  # restart a finished row
    return {
        "library": lib.name,
        "batch": batch,
        "steps": steps,
        "compile_s": compile_s,
        "mask_ms_median": statistics.median(times) * 1e3,
        "mask_ms_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
        "mask_us_per_row": statistics.median(times) * 1e6 / batch,
    }


def engine_throughput(model_dir, batches: list[int], max_tokens: int, dtype: str) -> list[dict]:
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.structured_output import StructuredOutputsParams

    engine = LLMEngine(EngineArgs(model=str(model_dir), dtype=dtype, max_num_seqs=16))
    rows = []
    for batch in batches:
        # untimed: the first steps at a new batch shape pay one-off costs (oneDNN primitives,
        # kernel dispatch) that would otherwise land on whichever condition runs first
        for i in range(batch):
            engine.add_request(
                f"warm{batch}-{i}",
                f"warm-up {batch} {i}",
                SamplingParams(max_tokens=8, ignore_eos=True),
            )
        while engine.has_unfinished():
            engine.step()
        for constrained in (False, True):
            so = StructuredOutputsParams(json=SCHEMA) if constrained else None
            for i in range(batch):
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0.8,
                    seed=i,
                    ignore_eos=not constrained,
                    structured_outputs=so,
                )
                # unique per run: no run may find another's prompt in the prefix cache
                prompt = f"Run {batch}{'c' if constrained else 'u'}, camera {i}: describe as JSON."
                engine.add_request(f"b{batch}-{constrained}-{i}", prompt, params)
            t0 = time.perf_counter()
            tokens, steps = 0, 0
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        tokens += len(out.outputs[0].token_ids)
                steps += 1
            elapsed = time.perf_counter() - t0
            row = {
                "batch": batch,
                "constrained": constrained,
                "tokens": tokens,
                "steps": steps,
                "seconds": elapsed,
                "tokens_per_s": tokens / elapsed,
            }
            log(json.dumps(row))
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: the qwen2_vl bench preset)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--steps", type=int, default=60, help="mask-fill steps per batch size")
    ap.add_argument("--max-tokens", type=int, default=48, help="decode tokens per request")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-mask", action="store_true")
    ap.add_argument("--out", default="structured_output.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result: dict = {"schema": SCHEMA, "vocab": QWEN2_CONFIG_VOCAB}
    if not args.skip_mask:
        log("building the synthetic 151k byte-level vocabulary")
        vocab = synthetic_vocab()
        masks = []
        for cls in (_XGrammar, _LLGuidance):
            t0 = time.perf_counter()
            lib = cls(vocab, eos=QWEN2_REGULAR_TOKENS)
            setup_s = time.perf_counter() - t0
            for batch in batches:
                row = mask_cost(lib, batch, args.steps, seed=batch)
                row["tokenizer_setup_s"] = setup_s
                log(json.dumps(row))
                masks.append(row)
        result["mask"] = masks
    if not args.skip_engine:
        model = bench_checkpoint("qwen2_vl", args.model)
        result["engine"] = engine_throughput(model, batches, args.max_tokens, args.dtype)
    save_json(args.out, result)
    print(json.dumps(result.get("mask", []) + result.get("engine", []), indent=1))


if __name__ == "__main__":
    main()
