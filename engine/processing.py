"""Input processing: chat template, image loading and preprocessing, M-RoPE positions.

Uses the checkpoint's own ``AutoProcessor`` (its chat template, image processor and tokenizer),
so a prompt is tokenised exactly as ``transformers`` would. Runs off the step loop (callers use a
thread pool): decoding and resizing a camera frame must not stall other requests' decodes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import itertools
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from engine.errors import EmptyPromptError, InvalidImageError, InvalidRequestError
from engine.prompt_guard import PromptLengthGuard
from engine.request import ImageInput, ProcessedPrompt

Messages = list[dict[str, Any]]
# vLLM's per-request ``mm_processor_kwargs`` keys we honour: the image size bounds (in pixels)
# the Qwen2-VL image processor resizes every image into. Image tokens scale with pixels.
MM_PROCESSOR_KEYS = ("min_pixels", "max_pixels")


def check_mm_processor_kwargs(kwargs: Any) -> dict[str, int]:
    """Validate a request's ``mm_processor_kwargs``; returns the overrides as plain ints.

    Only the known keys pass: anything else would reach the HF processor unchecked, where a
    typo is silently ignored (the caller pays for the tokens it meant to save) or fails deep
    inside it. Raises :class:`InvalidRequestError` (HTTP 400 on the server).
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError(
            "mm_processor_kwargs must be an object", param="mm_processor_kwargs"
        )
    out: dict[str, int] = {}
    for key, value in kwargs.items():
        param = f"mm_processor_kwargs.{key}"
        if key not in MM_PROCESSOR_KEYS:
            raise InvalidRequestError(
                f"mm_processor_kwargs: unsupported key {key!r} (supported: "
                f"{', '.join(MM_PROCESSOR_KEYS)})",
                param=param,
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{param} must be a positive integer, got {value!r}", param)
        out[key] = value
    return out


def load_image(source: Any) -> Image.Image:
    """PIL image from a PIL image, a ``data:`` URL, a ``file://`` URL or a local path."""
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, bytes):
        image = _open_bytes(source, "image bytes")
    elif isinstance(source, str | Path):
        text = str(source)
        if text.startswith("data:"):
            header, _, payload = text.partition(",")
            if ";base64" not in header or not payload:
                raise InvalidImageError("image data URL must be 'data:<mime>;base64,<data>'")
            try:
                raw = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidImageError(f"image data URL is not valid base64: {exc}") from None
            image = _open_bytes(raw, "image data URL")
        elif text.startswith(("http://", "https://")):
            raise InvalidImageError(
                "the engine does not fetch remote images; resolve http(s) URLs before submitting"
            )
        else:
            path = Path(text.removeprefix("file://"))
            if not path.is_file():
                raise InvalidImageError(f"image file not found: {path}")
            image = _open_bytes(path.read_bytes(), str(path))
    else:
        raise InvalidImageError(f"unsupported image type {type(source).__name__}")
    return image.convert("RGB") if image.mode != "RGB" else image


def _open_bytes(raw: bytes, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except Exception as exc:
        # any decoder failure is the client's bad image, never an engine crash (some libraries
        # patch Image.open and raise their own errors, e.g. ImportError for a missing plugin)
        raise InvalidImageError(f"cannot decode {what}: {exc}") from None
    if image.width < 1 or image.height < 1:
        raise InvalidImageError(f"{what} has no pixels")
    return image


def _split_messages(messages: Messages) -> tuple[Messages, list[Any]]:
    """OpenAI-style messages -> (messages the HF chat template understands, image sources)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out: Messages = []
    images: list[Any] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise InvalidRequestError(f"messages[{i}] must have a role", param=f"messages[{i}]")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string or a list of parts",
                param=f"messages[{i}].content",
            )
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind in ("image_url", "image", "input_image"):
                src = part.get(kind) if kind != "input_image" else part.get("image_url")
                if isinstance(src, dict):
                    src = src.get("url")
                if src is None:
                    raise InvalidImageError(
                        f"messages[{i}].content[{j}] has no image",
                        param=f"messages[{i}].content[{j}]",
                    )
                images.append(src)
                parts.append({"type": "image"})
            else:
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}]: unsupported part type {kind!r}",
                    param=f"messages[{i}].content[{j}].type",
                )
        out.append({"role": msg["role"], "content": parts})
    return out, images


class InputProcessor:
    """Prompts -> :class:`ProcessedPrompt`.

    ``min_pixels`` / ``max_pixels`` (``--min-pixels`` / ``--max-pixels``) replace the
    checkpoint's image size bounds engine-wide; ``None`` keeps the checkpoint's. A request's
    ``mm_processor_kwargs`` override them again for its own images only.
    """

    def __init__(
        self,
        model_dir: str | Path,
        hf_config,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.tokenizer = self.processor.tokenizer
        # set by the engine once it knows max_model_len: refuses over-long text before
        # tokenising it (engine.prompt_guard)
        self.length_guard: PromptLengthGuard | None = None
        self.image_token_id: int = hf_config.image_token_id
        self.spatial_merge_size: int = hf_config.vision_config.spatial_merge_size
        size = self.processor.image_processor.size  # transformers 5: shortest/longest_edge
        self.min_pixels = int(size["shortest_edge"]) if min_pixels is None else min_pixels
        self.max_pixels = int(size["longest_edge"]) if max_pixels is None else max_pixels
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels} (a bound not "
                "given comes from the checkpoint's image processor)"
            )

    # ---- public ---------------------------------------------------------------------------
    def process_chat(
        self,
        messages: Messages,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        size = self._image_size(mm_processor_kwargs)
        hf_messages, sources = _split_messages(messages)
        images = [self._load(src, n) for n, src in enumerate(sources)]
        text = self.processor.apply_chat_template(
            hf_messages,
            add_generation_prompt=True,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        return self._process(text, images, size)

    def process_prompt(
        self,
        prompt: str,
        images: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """A raw prompt (no chat template). Images need their placeholders in the text."""
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        size = self._image_size(mm_processor_kwargs)
        loaded = [self._load(src, n) for n, src in enumerate(images or [])]
        return self._process(prompt, loaded, size)

    def process(self, inputs: Any) -> ProcessedPrompt:
        """Dispatch on shape: str prompt, messages list, or a vLLM-style dict."""
        if isinstance(inputs, ProcessedPrompt):
            return inputs
        if isinstance(inputs, str):
            return self.process_prompt(inputs)
        if isinstance(inputs, list):
            return self.process_chat(inputs)
        if isinstance(inputs, dict):
            mm_kwargs = inputs.get("mm_processor_kwargs")
            if "messages" in inputs:
                return self.process_chat(
                    inputs["messages"], inputs.get("chat_template_kwargs"), mm_kwargs
                )
            if "prompt_token_ids" in inputs:
                ids = list(inputs["prompt_token_ids"])
                return self._from_ids(None, ids, [], None)
            if "prompt" in inputs:
                mm = inputs.get("multi_modal_data") or {}
                imgs = mm.get("image") or []
                return self.process_prompt(
                    inputs["prompt"], imgs if isinstance(imgs, list) else [imgs], mm_kwargs
                )
        raise InvalidRequestError(f"unsupported prompt type {type(inputs).__name__}")

    # ---- internals ------------------------------------------------------------------------
    def _load(self, source: Any, index: int) -> Image.Image:
        try:
            return load_image(source)
        except InvalidImageError as exc:
            raise InvalidImageError(f"image {index}: {exc}", param=exc.param) from None

    def _image_size(self, mm_processor_kwargs: dict[str, Any] | None) -> dict[str, int]:
        """The image processor's ``size`` for one request: the engine's bounds, with the
        request's ``mm_processor_kwargs`` on top (validated here, so the offline API and the
        server refuse the same things)."""
        overrides = check_mm_processor_kwargs(mm_processor_kwargs)
        lo = overrides.get("min_pixels", self.min_pixels)
        hi = overrides.get("max_pixels", self.max_pixels)
        if lo > hi:
            raise InvalidRequestError(
                f"mm_processor_kwargs: min_pixels {lo} > max_pixels {hi} (a bound not given "
                "is the server's)",
                param="mm_processor_kwargs",
            )
        return {"shortest_edge": lo, "longest_edge": hi}

    def _process(
        self, text: str, images: list[Image.Image], size: dict[str, int]
    ) -> ProcessedPrompt:
        if self.length_guard is not None:
            self.length_guard.check(text)
        # ``size`` goes to the image processor only (transformers 5 spelling of the bounds)
        kwargs: dict[str, Any] = {"images_kwargs": {"size": size}} if images else {}
        try:
            enc = self.processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
        except InvalidRequestError:
            raise
        except (ValueError, IndexError) as exc:  # e.g. placeholder count != image count
            raise InvalidRequestError(f"cannot process prompt: {exc}") from None
        ids = enc["input_ids"][0].tolist()
        grids = enc.get("image_grid_thw")
        pixels = enc.get("pixel_values")
        return self._from_ids(text, ids, images, (pixels, grids))

    def _from_ids(self, text, ids: list[int], images, mm) -> ProcessedPrompt:
        if not ids:
            raise EmptyPromptError("prompt is empty (tokenises to zero tokens)", param="messages")
        runs = _placeholder_runs(ids, self.image_token_id)
        image_inputs: list[ImageInput] = []
        if runs:
            pixels, grids = mm if mm else (None, None)
            if grids is None or len(grids) != len(runs):
                raise InvalidRequestError(
                    f"prompt has {len(runs)} image placeholder runs but "
                    f"{0 if grids is None else len(grids)} images"
                )
            patch_counts = grids.prod(-1).tolist()
            offsets = [0, *itertools.accumulate(patch_counts)]
            merge = self.spatial_merge_size**2
            for k, (start, length) in enumerate(runs):
                grid = tuple(int(x) for x in grids[k].tolist())
                px = pixels[offsets[k] : offsets[k + 1]].contiguous()
                if length != patch_counts[k] // merge:
                    raise InvalidRequestError(
                        f"image {k}: {length} placeholder tokens but the image has "
                        f"{patch_counts[k] // merge} embeddings"
                    )
                digest = hashlib.sha256(px.numpy().tobytes())
                digest.update(repr(grid).encode())
                image_inputs.append(ImageInput(digest.hexdigest(), start, length, px, grid))
        positions, delta = mrope_positions(ids, image_inputs, self.spatial_merge_size)
        return ProcessedPrompt(text, ids, positions, delta, image_inputs)


def _placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    runs, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == token_id:
            j = i
            while j < n and ids[j] == token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def mrope_positions(
    ids: list[int], images: list[ImageInput], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """Qwen2-VL 3-D positions: text advances all axes by one; an image's tokens take
    (t, row, col) offsets from the position where it starts, and the text after it resumes at
    ``start + max(rows, cols)``. Returns positions [3, len(ids)] and the delta for generated
    tokens (``position = index + delta``)."""
    chunks: list[torch.Tensor] = []
    cursor = 0  # token index
    pos = 0  # next text position
    for im in images:
        if im.offset > cursor:
            n = im.offset - cursor
            chunks.append((torch.arange(n) + pos).unsqueeze(0).expand(3, -1))
            pos += n
        t, h, w = im.grid_thw
        h, w = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = torch.meshgrid(
            torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"
        )
        chunks.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(h, w)
        cursor = im.offset + im.num_tokens
    if cursor < len(ids):
        n = len(ids) - cursor
        chunks.append((torch.arange(n) + pos).unsqueeze(0).expand(3, -1))
        pos += n
    positions = torch.cat(chunks, dim=1).contiguous() if chunks else torch.zeros(3, 0)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions.long(), delta
