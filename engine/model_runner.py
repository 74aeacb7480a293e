"""Executes one :class:`SchedulerOutput`: encode images, build the flat batch, forward, sample.

Owns the device-side state: the model, the paged KV cache tensors and the image embeddings.
It never looks at scheduler state; everything it needs arrives in the scheduler output.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.device import attention_backends
from engine.kernels import load_cpu_decode
from engine.layers.attention import build_attention_metadata, padded_block_tables
from engine.outputs import TokenLogprob
from engine.sampler import sample
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.step_interrupt import StepInterrupt, StepInterrupted
from engine.structured_output import BitmaskApplier

log = logging.getLogger("engine.runner")


@dataclass
class StepResult:
    sampled: dict[str, int]
    encode_s: float
    forward_s: float
    encoder_units: float  # vision work done this step (patch-block units)
    encoder_progress: dict[str, float]  # content hash -> work left (0: embeddings ready)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # requests that asked
    encoder_items: int = 0  # vision work items that work ran in (each has a fixed cost)
    # seconds in those items alone, what their prices are fitted on: a new job's set-up
    # (tens of MB of buffers for a frame) is no item's cost
    encoder_work_s: float = 0.0
    # given up for an arriving chat request (engine/step_interrupt.py): no chunk advanced,
    # nothing sampled; the encoder work above was done and counts
    interrupted: bool = False


class ModelRunner:
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: set[int],
        encoder_rows_per_item: int | None = 256,
        fused_prompt_rows: int = 16,
        gemv_max_rows: int = 4,
        weight_prefetch_bytes: int = 0,
        gemv_amx_tiles: bool = False,
        gemv_row_major: bool = True,
        amx_attention: bool = False,
        decode_graphs: str = "off",
        max_num_seqs: int = 1,
        max_model_len: int = 0,
    ) -> None:
        self.model = model
        # the platform plan's (engine/platform.py): rows of prompt steps in the fused kernel,
        # rows its own GEMV takes before oneDNN's packed GEMM, how far ahead it reads weights
        self.fused_prompt_rows = fused_prompt_rows
        self.gemv_max_rows = gemv_max_rows
        self.weight_prefetch_bytes = weight_prefetch_bytes
        self.gemv_amx_tiles = gemv_amx_tiles
        self.gemv_row_major = gemv_row_major
        self.amx_attention = amx_attention  # prompt chunks' attention in the fused kernel too
        # raised by the engine's front end when a chat request is queued: interruptible steps
        # stop at their next safe point (None: no step ever stops early)
        self.interrupt: StepInterrupt | None = None
        self.encoder_rows_per_item = encoder_rows_per_item
        self.encode_jobs: dict[str, object] = {}  # content hash -> VisionEncodeJob in progress
        self._step_logprobs: dict[str, TokenLogprob] = {}  # filled by _sample, one step's
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)
        slots = num_blocks * block_size
        # decode graphs' padding rows write to one scratch slot past the last block
        shape = (slots + (decode_graphs != "off"), model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(model.num_layers)
        ]
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self._fused_rows = 0
        self._kernel_rows = 0  # most rows one fused forward takes
        self._gemv_rows = 0  # rows past which the fused kernel's linears call oneDNN's GEMM
        self.fused_decoder = self._build_fused_decoder()
        # decode rows of mixed steps: engine.kernels' paged attention (bf16 CPU)
        self._native_attention = (
            getattr(model, "cpu_kernels", None) is not None
            and dtype == torch.bfloat16
            and device.type == "cpu"
        )
        self.fused_decode_steps = 0
        self.fused_prefill_steps = 0  # steps with prompt tokens run by the fused kernel
        # a key per prompt mid-prefill, under which the fused kernel keeps the prompt's packed
        # keys and values from one chunk to the next (FusedDecoder.forward's context_keys); a
        # recomputed prompt (preemption) gets a new one
        self._prompt_keys: dict[str, int] = {}
        self._next_prompt_key = itertools.count(1)
        self._bitmask: BitmaskApplier | None = None  # built on the first constrained row
        # decode-only steps as replayed CUDA graphs ("cuda", the platform plan's on a GPU),
        # or their padded forward run eagerly ("eager": how CPU tests check the padding)
        self.decode_graphs: DecodeGraphs | None = None
        if decode_graphs != "off":
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                block_size,
                max_num_seqs,
                max_model_len,
                scratch_slot=slots,
                device=device,
                capture=decode_graphs == "cuda",
            )

    # decode-only steps of up to this many rows run the fused kernel: its dot-product GEMV up
    # to ``gemv_max_rows`` rows, oneDNN's packed GEMM (called from the kernel) past that;
    # without packed weights (CPUs without bf16 arithmetic, whose oneDNN bf16 GEMM is emulated
    # and slower than the kernel's GEMV at any decode batch) the kernel takes up to 16 rows
    FUSED_DECODE_MAX_ROWS = 256
    UNPACKED_MAX_ROWS = 16
    # steps with prompt tokens run the fused kernel too while their rows (decodes + prompt
    # tokens) fit ``fused_prompt_rows`` (the platform plan's): a prompt row is then one more
    # row over weights read once, not an eager forward (per-op overhead, and in bf16 without
    # bf16 arithmetic a widening of every weight), so a few camera tokens ride beside chat
    # decodes for little more than their FLOPs. Each new token is one kernel row attending to
    # its own context length: the keys of the whole step are stored before any row attends, so
    # the chunk stays causal. How many rows pay off depends on the kernel's linears
    # (engine/platform.py: 16 over the emulated builds' panel GEMV, 1,024 over oneDNN's
    # packed GEMM).

    @property
    def fused_decode_rows(self) -> int:
        """Most decodes a step may hold and still run the fused kernel (0: no kernel)."""
        return self._fused_rows if self.fused_decoder is not None else 0

    @property
    def fused_prefill_rows(self) -> int:
        """Most rows (decodes + prompt tokens) a step with prompt tokens may hold and still
        run the fused kernel (0: such steps run eager)."""
        if self.fused_decoder is None:
            return 0
        return min(self.fused_prompt_rows, self._kernel_rows)

    @property
    def fused_gemv_rows(self) -> int:
        """Most rows the fused kernel's own GEMV takes before its linears switch to oneDNN's
        packed GEMM (0: no switch: no kernel, or no packed weights and the GEMV takes all).
        The switch costs a jump, not a slope (engine/cost_model.py: ``past_gemv``)."""
        return self._gemv_rows if self.fused_decoder is not None else 0

    def _build_fused_decoder(self):
        weights = getattr(self.model, "decode_kernel_weights_hp", None)
        kernels = load_cpu_decode() if weights is not None else None
        if kernels is None:
            return None
        packed = self.model.packed_decoder_weights()  # None when oneDNN packing is off
        per_layer = 7
        layers = []
        for i, (k_cache, v_cache) in enumerate(self.kv_caches):
            layer = [*weights[per_layer * i : per_layer * (i + 1)], k_cache, v_cache]
            if packed is not None:
                layer += packed[4 * i : 4 * (i + 1)]
            layers.append(layer)
        self._fused_rows = (
            self.FUSED_DECODE_MAX_ROWS if packed is not None else self.UNPACKED_MAX_ROWS
        )
        # the kernel caps its GEMV at 16 rows whatever it is asked (kMaxGemvRows)
        self._gemv_rows = min(self.gemv_max_rows, 16) if packed is not None else 0
        text = self.model.text_config
        scales = getattr(self.model, "decode_kernel_scales", None)  # int8 weights
        try:
            decoder = kernels.FusedDecoder(
                layers,
                weights[-2],
                weights[-1],
                None if packed is None else packed[-1],
                text.num_attention_heads,
                self.model.num_kv_heads,
                self.model.head_dim,
                float(text.rms_norm_eps),
                self.gemv_max_rows,
                **({} if scales is None else {"scales": scales}),
                # this decoder's own (read by the bf16 row-major GEMV only): two engines in
                # one process keep theirs (benchmarks.int8 times bf16 and int8 in turns)
                weight_prefetch=self.weight_prefetch_bytes,
            )
        except RuntimeError as exc:  # a shape the kernel does not take: eager decode
            log.warning("fused CPU decode off for this model: %s", exc)
            return None
        if self.gemv_amx_tiles and not decoder.set_amx_gemv(True):
            log.warning("AMX GEMV asked for but unavailable (OS or build): dot products")
        if not self.gemv_row_major and getattr(decoder, "drop_row_major", lambda: False)():
            # the decoder's copy was the last but ours: the model loader left the row-major
            # matrices on ordinary pages apart from the small tensors (engine/models)
            self.model.decode_kernel_weights_hp = None
            log.info("fused decoder: 1-row steps on the GEMV panels, row-major weights freed")
        if self.amx_attention and not decoder.set_amx_attention(True):
            log.warning("AMX attention asked for but unavailable (OS or build): dot products")
        # older builds have no max_rows(): the row-major kernel's limit
        self._kernel_rows = int(getattr(decoder, "max_rows", lambda: self.UNPACKED_MAX_ROWS)())
        return decoder

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        with attention_backends(self.device):
            return self._execute(sched)

    def drop_encodings(self, hashes: list[str]) -> None:
        """Free the embeddings and half-done jobs of images the encoder cache let go."""
        for h in hashes:
            self.encoder_outputs.pop(h, None)
            self.encode_jobs.pop(h, None)

    def forget_requests(self, request_ids: list[str]) -> None:
        """Requests whose prefill ended or will not go on as it was (aborted, preempted): the
        fused kernel lets their kept packing go."""
        for rid in request_ids:
            key = self._prompt_keys.pop(rid, None)
            if key is not None and self.fused_decoder is not None:
                self.fused_decoder.forget_context(key)

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        self.drop_encodings(sched.evicted_encoder_hashes)
        self.forget_requests(sched.preempted_ids)
        interrupt = self.interrupt if sched.interruptible else None
        encoding_interrupt = (
            self.interrupt if sched.interruptible or sched.encoding_interruptible else None
        )
        t0 = time.perf_counter()
        units, items, work_s, progress = self._encode(sched, encoding_interrupt)
        t1 = time.perf_counter()
        sampled: dict[str, int] = {}
        self._step_logprobs = {}
        # raised during the encoding (which then stopped), or before the forward: the chunks
        # may need what the encoding did not finish, and the chat waits for none of them
        interrupted = encoding_interrupt is not None and encoding_interrupt.requested()
        if sched.chunks and not interrupted:
            try:
                sampled = self._forward_and_sample(sched, interrupt)
            except StepInterrupted:
                interrupted, sampled, self._step_logprobs = True, {}, {}
            else:
                self.forget_requests(
                    [c.request_id for c in sched.chunks if c.sample and not c.is_decode]
                )
        t2 = time.perf_counter()
        return StepResult(
            sampled,
            t1 - t0,
            t2 - t1,
            units,
            progress,
            self._step_logprobs,
            encoder_items=items,
            encoder_work_s=work_s,
            interrupted=interrupted,
        )

    def _encode(
        self, sched: SchedulerOutput, interrupt: StepInterrupt | None = None
    ) -> tuple[float, int, float, dict[str, float]]:
        """Start new encoding jobs and advance each by the work the scheduler granted (up to
        ``interrupt``, checked between items: the jobs start whatever happens, as the
        scheduler counts them started)."""
        for job in sched.encoder_jobs:
            grid = torch.tensor([job.grid_thw], dtype=torch.long)
            if self.model.vision_impl == "hf":  # the transformers tower: whole image, now
                emb = self.model.encode_images(job.pixel_values.to(self.device), grid)[0]
                self.encoder_outputs[job.content_hash] = emb.to(self.dtype)
                continue
            tower = self.model.vision_tower(self.encoder_rows_per_item)
            self.encode_jobs[job.content_hash] = tower.job(job.pixel_values, grid)
        spent, items, work_s, progress = 0.0, 0, 0.0, {}
        for h, units in sched.encoder_work.items():
            job = self.encode_jobs.get(h)
            if job is None:
                progress[h] = 0.0 if h in self.encoder_outputs else progress.get(h, 0.0)
                continue
            before, t0 = job.items_run, time.perf_counter()
            spent += job.advance(
                units,
                sched.encoder_item_overhead,
                stop=interrupt.requested if interrupt is not None else None,
            )
            work_s += time.perf_counter() - t0
            items += job.items_run - before
            if job.done():
                self.encoder_outputs[h] = job.result()[0].to(self.dtype)
                del self.encode_jobs[h]
                progress[h] = 0.0
            else:
                progress[h] = job.remaining_cost
        return spent, items, work_s, progress

    def _forward_and_sample(
        self, sched: SchedulerOutput, interrupt: StepInterrupt | None = None
    ) -> dict[str, int]:
        """``interrupt``: checked at the safe points of the eager forward (after each decoder
        layer's attention and between layers), which an interruptible step's prompt rows always
        run (the fused kernel has no safe point)."""
        chunks = sched.chunks
        bucket = self.decode_graphs.bucket(chunks) if self.decode_graphs is not None else None
        if bucket is not None:
            return self._sample(self.decode_graphs.logits(chunks, bucket), chunks)
        if self._fused_decode_applies(chunks):
            return self._sample(self._fused_decode_logits(chunks), chunks)
        if interrupt is None and self._fused_prefill_applies(chunks):
            logits, sampled_chunks = self._fused_step_logits(chunks)
            return self._sample(logits, sampled_chunks) if sampled_chunks else {}
        positions = torch.cat([c.position_ids() for c in chunks], dim=1)
        hidden = self._input_embeddings(chunks)
        meta = build_attention_metadata(
            [c.block_table for c in chunks],
            [c.start for c in chunks],
            [c.num_tokens for c in chunks],
            self.block_size,
            self.device,
            native_decode=self._native_attention,
        )
        hidden = self.model(
            hidden,
            positions.to(self.device),
            self.kv_caches,
            meta,
            safe_point=interrupt.check if interrupt is not None else None,
        )

        sample_rows, sampled_chunks = _sampled_rows(chunks)
        if not sample_rows:
            return {}
        return self._sample(self.model.logits(hidden[sample_rows]), sampled_chunks)

    def _input_embeddings(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Token embeddings of the step's rows, image placeholders replaced by the encoder's
        output for them."""
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        hidden = self.model.embed(ids.to(self.device))
        row = 0
        for c in chunks:
            for content_hash, lo, hi, offset in c.image_slices:
                emb = self.encoder_outputs[content_hash]
                hidden[row + offset : row + offset + (hi - lo)] = emb[lo:hi]
            row += c.num_tokens
        return hidden

    def _fused_prefill_applies(self, chunks: list[ScheduledChunk]) -> bool:
        return (
            self.fused_prefill_rows > 0
            and sum(c.num_tokens for c in chunks) <= self.fused_prefill_rows
        )

    def _fused_step_logits(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """A step with prompt tokens as one native call: every new token is a kernel row with
        its chunk's block table and its own context length. Returns the logits of the rows
        that sample, and their chunks."""
        positions = torch.cat([c.position_ids() for c in chunks], dim=1)
        cos, sin = self.model.rotary.cos_sin(positions, self.dtype)
        tables = padded_block_tables([c.block_table for c in chunks for _ in range(c.num_tokens)])
        lengths = torch.tensor(
            [c.start + i + 1 for c in chunks for i in range(c.num_tokens)], dtype=torch.long
        )
        rows, sampled_chunks = _sampled_rows(chunks)
        self.fused_prefill_steps += 1
        # only the sampled rows through the lm_head: the rest of a chunk needs no logits
        logits = self.fused_decoder.forward(
            self._input_embeddings(chunks),
            cos,
            sin,
            tables,
            lengths,
            self.block_size,
            torch.tensor(rows, dtype=torch.long),
            self._context_keys(chunks),
        )
        return logits, sampled_chunks

    def _context_keys(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Per row: its prompt's key, 0 for decodes and for a prompt done in one chunk.

        Why none for a one-chunk prompt: its packing has no next chunk to serve, and the kernel
        keeps a few contexts only, the least recently used going first. Each chat arriving
        beside four camera frames mid-prefill pushed out a frame's packing, which its next
        chunk then packed afresh: a 4-row chunk at 1,000 keys beside 4 decodes took 6.8 ms
        over the decodes against 4.3 with the packing kept (2,000 keys: 12.8 / 6.8; bench,
        2-core AMX Xeon)."""
        keys = []
        for c in chunks:
            key = 0
            if not c.is_decode:
                key = self._prompt_keys.get(c.request_id, 0)
                if not key and not c.sample:  # a last chunk without one: none to serve
                    key = self._prompt_keys[c.request_id] = next(self._next_prompt_key)
            keys.extend([key] * c.num_tokens)
        return torch.tensor(keys, dtype=torch.long)

    def _fused_decode_applies(self, chunks: list[ScheduledChunk]) -> bool:
        return (
            self.fused_decoder is not None
            and len(chunks) <= self._fused_rows
            and all(c.is_decode and c.num_tokens == 1 and c.sample for c in chunks)
        )

    def _fused_decode_logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """A decode-only step as one native call (engine/kernels/cpu_decode.cpp)."""
        ids = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.long)
        text_positions = [c.text_position for c in chunks]
        if None in text_positions:
            positions = torch.cat([c.position_ids() for c in chunks], dim=1)
            cos, sin = self.model.rotary.cos_sin(positions, self.dtype)
        else:
            cos, sin = self.model.rotary.cos_sin_at(text_positions, self.dtype)
        tables = padded_block_tables([c.block_table for c in chunks])
        lengths = torch.tensor([c.start + 1 for c in chunks], dtype=torch.long)
        self.fused_decode_steps += 1
        return self.fused_decoder.forward(
            self.model.embed(ids), cos, sin, tables, lengths, self.block_size
        )

    def _sample(self, logits: torch.Tensor, sampled_chunks: list[ScheduledChunk]) -> dict[str, int]:
        banned = [
            (self.eos_token_ids + list(c.params.stop_token_ids))
            if len(c.output_token_ids) < c.params.min_tokens
            else []
            for c in sampled_chunks
        ]
        self._apply_grammars(logits, sampled_chunks, banned)
        out = sample(
            logits,
            [c.params for c in sampled_chunks],
            [c.generator for c in sampled_chunks],
            banned,
            [(c.prompt_token_ids, c.output_token_ids) for c in sampled_chunks],
        )
        for c, lp in zip(sampled_chunks, out.logprobs, strict=True):
            if lp is not None:
                self._step_logprobs[c.request_id] = lp
        return {c.request_id: t for c, t in zip(sampled_chunks, out.token_ids, strict=True)}

    def _apply_grammars(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk], banned: list[list[int]]
    ) -> None:
        """Constrained decoding: mask each constrained row to its grammar's allowed tokens.
        The grammar alone decides when such a row may end, so its min_tokens ban is lifted (a
        complete grammar allows only the stop tokens; banning them too would leave nothing)."""
        rows = [(i, c.grammar) for i, c in enumerate(chunks) if c.grammar is not None]
        if not rows:
            return
        if self._bitmask is None:
            self._bitmask = BitmaskApplier(logits.shape[-1])
        self._bitmask.apply(logits, rows)
        for i, _ in rows:
            banned[i] = []


def _sampled_rows(chunks: list[ScheduledChunk]) -> tuple[list[int], list[ScheduledChunk]]:
    """The step's rows that sample (each sampling chunk's last token) and their chunks: the
    only rows whose logits a step needs, eager or fused."""
    rows, sampled, row = [], [], 0
    for c in chunks:
        row += c.num_tokens
        if c.sample:
            rows.append(row - 1)
            sampled.append(c)
    return rows, sampled
