"""Structured output: grammars compiled from a request's spec, one matcher per request, and the
token bitmask those matchers put on the logits rows they sample.

The grammar library is xgrammar (chosen over llguidance by its per-step mask cost at batch 16
on a 151k vocabulary: benchmarks/structured_output.py, figures in benchmarks/README.md).

Life of a constrained request:
- at admission (``LLMEngine.validate``, on the caller's thread) the spec is compiled, once per
  distinct ``(kind, spec)``, cached: a bad schema is a 400 there, never an error on the step
  thread, and the step thread never compiles;
- the request owns a :class:`GrammarState` (its matcher); the scheduler hands it to the runner
  with each chunk that samples;
- the runner fills the bitmask of exactly the rows it samples (a prefill chunk that does not
  reach the end of the prompt has no row) and masks their logits before ``sample``;
- the scheduler advances the matcher with each token it appends to the output, the one place
  tokens are accepted, so a preempted request (which keeps its output tokens and recomputes
  their KV) never advances its matcher twice;
- when the grammar is complete only the stop tokens stay allowed; a terminated matcher is a
  ``stop`` finish even with ``ignore_eos``.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("engine.structured_output")

# distinct compiled grammars kept (compiling a schema costs ~0.1-1 s on a 151k vocabulary)
GRAMMAR_CACHE_SIZE = 256
# xgrammar's character class for strings with minLength/maxLength, and the JSON-correct one
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


@dataclass
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one of the constraints.

    ``param`` is the request field the spec came from (``response_format``, ``guided_json``,
    ``tool_choice`` ...), so an error names what the client actually sent.
    """

    json: dict[str, Any] | str | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    param: str = "structured_outputs"

    def validate(self) -> None:
        """Shape checks that need no tokenizer; compiling happens in :class:`GrammarCompiler`."""
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                f"exactly one structured output constraint is required, got {given or 'none'}",
                param=self.param,
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError(
                        f"JSON schema is not valid JSON: {exc}", param=self.param
                    ) from None
            else:
                parsed = self.json
            if not isinstance(parsed, dict | bool):
                raise InvalidRequestError("a JSON schema must be an object", param=self.param)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidRequestError("regex must be a non-empty string", param=self.param)
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(
                "choice must be a non-empty list of non-empty strings", param=self.param
            )

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): the cache key of the compiled grammar."""
        if self.json is not None:
            spec = (
                self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            )
            return "json", spec
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        return "choice", json.dumps(self.choice)


class GrammarState:
    """One request's matcher: which tokens may come next, advanced by each accepted token."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            # only possible if a row was sampled without its mask: a bug, not bad input
            log.error("grammar rejected token %d after %d tokens", token, self.num_accepted)
            return
        self.num_accepted += 1


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe, cached by ``(kind, spec)``."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: set[int]
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._cache: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar, or ``InvalidRequestError`` naming ``spec.param``."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        kind, text = key
        try:
            if kind in ("json", "json_object"):
                schema = text if kind == "json" else '{"type": "object"}'
                compiled = self._compiler.compile_grammar(self._json_grammar(schema))
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            else:
                alternatives = " | ".join(json.dumps(c) for c in json.loads(text))
                compiled = self._compiler.compile_grammar(f"root ::= {alternatives}")
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its reason
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(
                f"invalid {kind.replace('_', ' ')} constraint: {reason}", param=spec.param
            ) from None
        with self._lock:
            if len(self._cache) >= GRAMMAR_CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled

    def _json_grammar(self, schema: str) -> str:
        """The schema's grammar (compact separators: ``any_whitespace`` would let a model
        emit whitespace forever), with xgrammar 0.2.9's length-bounded string rule fixed: it
        reads ``[^"\\\r\n]{min,max}``, admitting raw control characters that JSON forbids
        (found by the Frigate test), so they are excluded as its unbounded strings do."""
        ebnf = str(self._xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)))


class BitmaskApplier:
    """Fills the packed bitmask of the constrained rows of a sampling batch and masks their
    logits (disallowed tokens to ``-inf``); one per runner, reusing its buffer."""

    def __init__(self, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)
        self._batch = xgr.BatchGrammarMatcher(max_threads=2)

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, GrammarState]]) -> None:
        """``rows``: (row index in ``logits``, that row's grammar) for the constrained rows."""
        rows = [(i, g) for i, g in rows if not g.terminated]
        if not rows:
            return
        if self._mask.shape[0] < len(rows):
            self._mask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        mask = self._mask[: len(rows)]
        if len(rows) == 1:
            rows[0][1].matcher.fill_next_token_bitmask(mask, 0)
        else:
            self._batch.batch_fill_next_token_bitmask([g.matcher for _, g in rows], mask)
        indices = [i for i, _ in rows]
        full = torch.full((logits.shape[0], mask.shape[1]), -1, dtype=mask.dtype)
        full[indices] = mask
        self._xgr.apply_token_bitmask_inplace(
            logits, full.to(logits.device, non_blocking=True), vocab_size=self.vocab_size
        )
