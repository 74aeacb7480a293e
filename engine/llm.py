"""Offline API mirroring vLLM: ``LLM(model=...)``, ``generate`` and ``chat``."""

from __future__ import annotations

import itertools
import logging
from typing import Any

from tqdm import tqdm

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("engine")


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        # Offline, steps are sized by tokens alone (``--max-num-batched-tokens``, else the
        # token cap), as in vLLM's LLM: the server's time limits keep streaming chat fluid
        # and bound an arriving request's wait, and an offline batch has neither -- under
        # them 16 prompts were prefilled a few tokens a step beside the first one's decode
        # (3.5x slower on a 2-core AVX2 EPYC). Asked for explicitly, they still apply.
        engine_args.setdefault("target_itl_ms", "off")
        engine_args.setdefault("max_step_ms", "off")
        self.engine = LLMEngine(EngineArgs(model=str(model), **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Prompts: a str, a vLLM-style dict (``prompt``, ``multi_modal_data``,
        ``mm_processor_kwargs``), or a list of those; batched together."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict[str, int] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of conversations (OpenAI-style messages, image parts OK).

        ``mm_processor_kwargs`` (``min_pixels`` / ``max_pixels``) resize these conversations'
        images within other bounds than the engine's, as in vLLM.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        inputs = [
            {
                "messages": c,
                "chat_template_kwargs": chat_template_kwargs,
                "mm_processor_kwargs": mm_processor_kwargs,
            }
            for c in conversations
        ]
        return self._run(inputs, sampling_params, use_tqdm)

    def _run(self, inputs: list[Any], params, use_tqdm: bool) -> list[RequestOutput]:
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError("need one SamplingParams per prompt (or a single one)")
        # validate everything before scheduling anything: a bad prompt adds nothing
        processed = [self.engine.process_inputs(x) for x in inputs]
        for p, sp in zip(processed, params, strict=True):
            self.engine.validate(p, sp)
        order: dict[str, int] = {}
        for i, (p, sp) in enumerate(zip(processed, params, strict=True)):
            rid = f"offline-{next(self._ids)}"
            order[rid] = i
            self.engine.add_processed(rid, p, sp)
        results: list[RequestOutput | None] = [None] * len(inputs)
        bar = tqdm(total=len(inputs), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
        bar.close()
        return [r for r in results if r is not None]
