"""The synchronous engine: owns scheduler, runner and detokenizers; one ``step()`` at a time.

``LLM`` (offline) drives it in a loop; ``AsyncEngine`` drives it from a background thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from engine.calibration import calibrate_cached, calibration_key, log_step_policy
from engine.config import EngineArgs
from engine.detokenizer import IncrementalDetokenizer
from engine.device import (
    freeze_loaded_objects,
    keep_freed_host_memory,
)
from engine.encoder_cache import EncoderCacheManager
from engine.errors import InvalidRequestError, PromptTooLongError, QueueFullError
from engine.host_memory import resident_mib, trim_heap
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.model_source import model_display_name
from engine.models import load_model
from engine.outputs import CompletionOutput, RequestOutput
from engine.platform import resolve_platform
from engine.processing import InputProcessor
from engine.prompt_guard import PromptLengthGuard
from engine.request import Priority, ProcessedPrompt, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.stats import EngineStats
from engine.step_interrupt import StepInterrupt
from engine.step_trace import StepTrace
from engine.structured_output import GrammarCompiler

log = logging.getLogger("engine")


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        if not args.model:
            raise ValueError("EngineArgs.model: path to a checkpoint directory is required")
        self.args = args
        self.platform = resolve_platform(args)  # every hardware-dependent choice, once
        self.device = self.platform.device
        self.dtype = self.platform.dtype
        if self.device.type == "cpu":
            keep_freed_host_memory()
            if args.num_threads:
                torch.set_num_threads(args.num_threads)
        torch.manual_seed(args.seed)
        self.model_dir = args.model_path()  # a Hub id is fetched into the HF cache first
        self.model_name = model_display_name(args.model)
        self.model, self.hf_config, self.architecture = load_model(
            self.model_dir, self.dtype, self.device, plan=self.platform
        )
        self.processor = InputProcessor(
            self.model_dir, self.hf_config, min_pixels=args.min_pixels, max_pixels=args.max_pixels
        )
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = self._eos_ids()

        text_cfg = self.hf_config.text_config
        max_pos = getattr(text_cfg, "max_position_embeddings", 32768)
        self.max_model_len = min(args.max_model_len or max_pos, max_pos)
        self.processor.length_guard = PromptLengthGuard(self.tokenizer, self.max_model_len)

        per_block = ModelRunner.kv_bytes_per_block(self.model, args.block_size, self.dtype)
        num_blocks = args.num_kv_blocks or max(
            1, int(args.kv_cache_memory_gb * (1 << 30)) // per_block
        )
        # never more blocks than max_num_seqs full-length sequences could use
        num_blocks = min(num_blocks, args.max_num_seqs * -(-self.max_model_len // args.block_size))
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.encoder_cache = EncoderCacheManager(args.encoder_cache_size)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            args.block_size,
            self.dtype,
            self.device,
            self.eos_token_ids,
            encoder_rows_per_item=self.platform.encoder_rows_per_item,
            fused_prompt_rows=self.platform.fused_prompt_rows,
            gemv_max_rows=self.platform.gemv_max_rows,
            weight_prefetch_bytes=self.platform.weight_prefetch_bytes,
            gemv_amx_tiles=self.platform.gemv_amx_tiles,
            gemv_row_major=self.platform.gemv_row_major,
            amx_attention=self.platform.amx_attention,
            decode_graphs=self.platform.decode_graphs,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        before, released = resident_mib(), trim_heap()
        after = resident_mib()
        log.info(
            "host memory after load: %.0f MiB resident (%.0f MiB of freed heap returned)",
            after,
            before - after if released else 0,
        )
        # raised by a front end on another thread when it queues a chat request; lowered by
        # its step loop before it takes queued requests in (engine/step_interrupt.py)
        self.step_interrupt = StepInterrupt()
        self.runner.interrupt = self.step_interrupt
        limits = args.step_limits()
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=limits.max_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=args.enable_chunked_prefill,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                target_itl_s=limits.target_itl_s,
                max_step_s=limits.max_step_s,
                auto_target_factor=args.auto_itl_factor,
                enable_chunked_encoder=args.enable_chunked_encoder,
                encoder_unit_tokens=self.model.encoder_unit_tokens(),
                fused_decode_rows=self.runner.fused_decode_rows,
                fused_prefill_rows=self.runner.fused_prefill_rows,
                fused_gemv_rows=self.runner.fused_gemv_rows,
                interrupt_points=self._interrupt_points(args),
            ),
            self.kv,
            self.encoder_cache,
        )
        if limits.time_sized:  # a time limit is only as good as the cost model
            calibrate_cached(
                self.runner,
                self.kv,
                self.scheduler.cost_model,
                limits.max_tokens,
                args.max_num_seqs,
                key=calibration_key(self),
                max_model_len=self.max_model_len,
            )
        log_step_policy(self.scheduler, args)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._grammar_compiler: GrammarCompiler | None = None  # on the first constrained request
        self._grammar_lock = threading.Lock()
        self.last_step_idle = False  # the last step had nothing to run
        self.stats = EngineStats(kv_blocks_total=num_blocks)
        self.step_trace = StepTrace(args.step_trace) if args.step_trace else None
        freeze_loaded_objects()
        log.info(
            "engine_ready model=%s arch=%s dtype=%s device=%s kv_blocks=%d block_size=%d "
            "max_model_len=%d token_cap=%d chunked=%s",
            self.model_name,
            self.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device,
            num_blocks,
            args.block_size,
            self.max_model_len,
            limits.max_tokens,
            args.enable_chunked_prefill,
        )

    def _interrupt_points(self, args: EngineArgs) -> int:
        """How many step bounds an interruptible step may run (0: off, or no step bound to
        multiply; engine/step_interrupt.py): as many as keep each stretch between two safe
        points within one bound, so a chat still waits one short step at most. Its safe points
        split a layer into the attention, the MLP's gate/up product and its down product; with
        the longest of them half a layer's weights (bench; 0.59 for Qwen2-VL-2B) a layer may
        take two bounds. Why longer steps: each chunk of a camera prompt pays a per-step floor
        (eager overhead, bf16 weights widened per chunk on AVX2), and camera-only work in
        ~one-bound-per-layer chunks cost 6.4-6.7 % against a fixed 2,048-token budget on a
        2-core AVX2 EPYC (``benchmarks.default_cost``, session 30)."""
        if not args.interruptible_steps or not args.time_sized:
            return 0
        layers = self.model.layers
        shares = [getattr(layer, "longest_part_share", 1.0) for layer in layers]
        return max(len(layers), int(sum(1 / share for share in shares)))

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen_path = self.model_dir / "generation_config.json"
        if gen_path.exists():
            import json

            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -------------------------------------------------------------------------
    def process_inputs(self, inputs: Any) -> ProcessedPrompt:
        """Tokenise and preprocess; thread-safe, meant to run off the step loop."""
        return self.processor.process(inputs)

    def grammar_compiler(self) -> GrammarCompiler:
        """Built once, lazily: indexing a 151k vocabulary costs about a second."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.hf_config.text_config.vocab_size, self.eos_token_ids
                )
            return self._grammar_compiler

    def validate(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        if params.structured_outputs is not None:  # compiled here, cached: a bad spec is a 400
            self.grammar_compiler().compile(params.structured_outputs)
        n = len(prompt.token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {n} tokens; this model's context (max_model_len) is "
                f"{self.max_model_len}, leaving no room to generate",
                param="messages",
            )
        # vLLM and OpenAI refuse an output limit the context cannot hold, rather than cutting
        # the answer short with finish_reason="length" the client did not ask for.
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + params.max_tokens} tokens ({n} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                param="max_tokens",
            )
        if -(-(n + 1) // self.args.block_size) > self.kv.num_blocks:
            raise PromptTooLongError(
                f"prompt of {n} tokens does not fit the KV cache "
                f"({self.kv.num_blocks} blocks of {self.args.block_size})",
                param="messages",
            )
        vocab = self.hf_config.text_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt.token_ids):
            raise InvalidRequestError("prompt token id out of the vocabulary", param="prompt")
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            bad = next(t for t in params.logit_bias if t >= vocab)
            raise InvalidRequestError(
                f"logit_bias token id {bad} is out of the vocabulary (size {vocab})",
                param="logit_bias",
            )

    def add_request(
        self,
        request_id: str,
        inputs: Any,
        params: SamplingParams | None = None,
        priority: str | Priority | None = None,
        deadline_s: float | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        params = params or SamplingParams()
        prompt = self.process_inputs(inputs)
        return self.add_processed(request_id, prompt, params, priority, deadline_s, arrival_time)

    def add_processed(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        priority: str | Priority | None = None,
        deadline_s: float | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt, params)
        if self.args.max_queue_len and len(self.scheduler.waiting) >= self.args.max_queue_len:
            raise QueueFullError(f"waiting queue is full ({self.args.max_queue_len} requests)")
        req = Request(
            request_id,
            prompt,
            params,
            self.eos_token_ids,
            Priority.parse(priority),
            deadline_s,
            arrival_time,
        )
        if params.structured_outputs is not None:
            req.grammar = self.grammar_compiler().new_state(params.structured_outputs)
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, params, prompt.token_ids
        )
        self.scheduler.add_request(req)
        self.stats.total_prompt_tokens += req.num_prompt_tokens
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        # its half-done image encodings go now, not at the next step (an idle engine has none)
        self.runner.drop_encodings(self.scheduler.encoder_cache.take_abandoned())
        self.runner.forget_requests([request_id])
        return self._make_output(req, [], finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        sched = self.scheduler.schedule()
        self.last_step_idle = sched.is_empty and not sched.expired
        result = self.runner.execute(sched) if not sched.is_empty else None
        if result is None:  # nothing to run, but expired requests may have left encodings
            self.runner.drop_encodings(sched.evicted_encoder_hashes)
        progressed, finished = self.scheduler.update_from_output(
            sched,
            result.sampled if result else {},
            result.encoder_progress if result else None,
            interrupted=result is not None and result.interrupted,
        )
        if result is not None and result.logprobs:
            for req, _ in progressed:
                lp = result.logprobs.get(req.request_id)
                if lp is not None:
                    req.output_logprobs.append(lp)
        outputs: list[RequestOutput] = []
        done_ids = {r.request_id for r in finished}
        for req, new_ids in progressed:
            if req.request_id in done_ids:
                continue
            out = self._make_output(req, new_ids, finished=False)
            if out is not None:
                outputs.append(out)
        for req in finished:
            new_ids = (
                req.output_token_ids[-1:]
                if req.status is not RequestStatus.FINISHED_EXPIRED
                else []
            )
            out = self._make_output(req, new_ids, finished=True)
            if out is not None:
                outputs.append(out)
        self._record_step(sched, result, time.perf_counter() - t0, time.thread_time() - cpu0)
        return outputs

    def _make_output(
        self, req: Request, new_ids: list[int], finished: bool
    ) -> RequestOutput | None:
        detok = self.detokenizers.get(req.request_id)
        if detok is None:
            return None
        delta = detok.add(new_ids, finished)
        if detok.stop_hit is not None and not finished:
            # a stop string ends the request here, whatever the model would say next
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = detok.stop_hit
            finished = True
            delta += detok.add([], True)
        if finished:
            self.detokenizers.pop(req.request_id, None)
            self.stats.total_generation_tokens += len(req.output_token_ids)
            self.stats.record_finished(req)
        reason = req.status.value if finished else None
        logprobs = delta_logprobs = None
        if req.params.logprobs is not None:
            kept = req.output_logprobs
            delta_logprobs = kept[len(kept) - len(new_ids) :] if new_ids else []
            logprobs = list(kept) if finished else None  # whole list once: no O(n^2) copies
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=detok.output_text(),
                    token_ids=list(req.output_token_ids),
                    finish_reason=reason,
                    stop_reason=req.stop_reason if finished else None,
                    delta_text=delta,
                    delta_token_ids=list(new_ids),
                    logprobs=logprobs,
                    delta_logprobs=delta_logprobs,
                )
            ],
            finished=finished,
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
            num_image_tokens=req.prompt.num_image_tokens,
        )

    def _record_step(self, sched, result, elapsed: float, cpu_s: float | None = None) -> None:
        s = self.stats
        if sched.is_empty:
            return
        encoder_s = None
        if result is not None:
            sched.features.encoder_units = result.encoder_units  # what actually ran
            sched.features.encoder_items = result.encoder_items
            encoder_s = result.encoder_work_s
        if result is not None and result.interrupted:
            s.num_interrupted_steps += 1  # its time is no price of what it was sized for
        else:
            self.scheduler.cost_model.observe(sched.features, elapsed, encoder_s)
            self.scheduler.observe_step(sched, elapsed)
        if self.step_trace is not None:
            self.step_trace.record(sched, result, elapsed, cpu_s)
        s.num_steps += 1
        s.last_step_time_s = elapsed
        s.record_step_time(elapsed)
        s.total_step_time_s += elapsed
        s.last_step_prefill_tokens = sched.num_prefill_tokens
        s.last_step_decode_tokens = sched.num_decode_tokens
        s.last_step_encoder_s = result.encode_s if result else 0.0
        if result is None or not result.interrupted:
            s.total_prefill_tokens_computed += sched.num_prefill_tokens
            s.record_step_tokens(sched.num_prefill_tokens + sched.num_decode_tokens)

    def close(self) -> None:
        """Release what the engine holds open beyond memory (the step trace's file)."""
        if self.step_trace is not None:
            self.step_trace.close()

    def get_stats(self) -> EngineStats:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_blocks_used = self.kv.num_blocks - self.kv.num_free_blocks
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_aborted = self.scheduler.num_aborted
        s.num_expired = self.scheduler.num_expired
        s.encoder_cache_hits = self.encoder_cache.hits
        s.encoder_cache_misses = self.encoder_cache.misses
        s.prefix_cache_queries = self.kv.prefix_queries
        s.prefix_cache_hits = self.kv.prefix_hits
        s.cost_model = self.scheduler.cost_model.coefficients()
        s.itl_target_s = self.scheduler.last_target_s
        s.prefill_budget = self.scheduler.last_prefill_budget
        return s.snapshot()
