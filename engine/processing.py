"""Input processing: chat template, image and video loading and preprocessing, M-RoPE positions.

Uses the checkpoint's own ``AutoProcessor`` (its chat template, image processor and tokenizer),
so a prompt is tokenised exactly as ``transformers`` would. Runs off the step loop (callers use a
thread pool): decoding and resizing a camera frame must not stall other requests' decodes.

A video is a list of frames (``{"type": "video", "video": [frame, ...], "fps": 2.0}``, Qwen's
own part shape): the checkpoint's video processor pairs frames into temporal patches (an odd
count repeats the last frame), and the clip becomes one media item with ``grid_thw[0] > 1``.
The engine decodes no video files; the server samples frames from those first.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from engine.errors import EmptyPromptError, InvalidImageError, InvalidRequestError
from engine.prompt_guard import PromptLengthGuard
from engine.request import ImageInput, ProcessedPrompt

Messages = list[dict[str, Any]]
# a prompt's media in order: ("image", source) or ("video", VideoSource)
Media = list[tuple[str, Any]]
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


@dataclass(frozen=True)
class VideoSource:
    """A clip as the engine takes it: its frames (anything :func:`load_image` opens) and the
    rate they were sampled at (``None``: unknown, the video processor's default applies)."""

    frames: list[Any]
    fps: float | None = None


def _video_source(part: dict, param: str) -> VideoSource:
    """``{"type": "video", "video": [frames], "fps": x}``; ``video`` may also be
    ``{"frames": [...], "fps": x}`` or a :class:`VideoSource`."""
    src = part.get("video")
    fps = part.get("fps")
    if isinstance(src, VideoSource):
        return src
    if isinstance(src, dict):
        fps = src.get("fps", fps)
        src = src.get("frames")
    if not isinstance(src, list | tuple) or not src:
        raise InvalidRequestError(
            f"{param}.video must be a non-empty list of frames", param=f"{param}.video"
        )
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0):
        raise InvalidRequestError(f"{param}.fps must be a positive number", param=f"{param}.fps")
    return VideoSource(list(src), None if fps is None else float(fps))


def _split_messages(messages: Messages) -> tuple[Messages, Media]:
    """OpenAI-style messages -> (messages the HF chat template understands, media sources)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out: Messages = []
    images: Media = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise InvalidRequestError(f"messages[{i}] must have a role", param=f"messages[{i}]")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            text = [{"type": "text", "text": content}]
            out.append({**_tool_fields(msg), "role": msg["role"], "content": text})
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
                images.append(("image", src))
                parts.append({"type": "image"})
            elif kind == "video":
                images.append(("video", _video_source(part, f"messages[{i}].content[{j}]")))
                parts.append({"type": "video"})
            else:
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}]: unsupported part type {kind!r}",
                    param=f"messages[{i}].content[{j}].type",
                )
        out.append({**_tool_fields(msg), "role": msg["role"], "content": parts})
    return out, images


def _tool_fields(msg: dict) -> dict:
    """An assistant message's ``tool_calls`` and a tool message's ``tool_call_id``, which the
    chat template renders (Qwen's ``<tool_call>`` / ``<tool_response>`` blocks)."""
    return {k: msg[k] for k in ("tool_calls", "tool_call_id") if msg.get(k) is not None}


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
        self.video_token_id: int | None = getattr(hf_config, "video_token_id", None)
        self.spatial_merge_size: int = hf_config.vision_config.spatial_merge_size
        # Qwen2.5-VL spaces a clip's temporal positions by real time (transformers'
        # get_rope_index); Qwen2-VL steps them by one per temporal patch
        self.tokens_per_second: int | None = (
            getattr(hf_config.vision_config, "tokens_per_second", None)
            if getattr(hf_config, "model_type", "") == "qwen2_5_vl"
            else None
        )
        size = self.processor.image_processor.size  # transformers 5: shortest/longest_edge
        self.min_pixels = int(size["shortest_edge"]) if min_pixels is None else min_pixels
        self.max_pixels = int(size["longest_edge"]) if max_pixels is None else max_pixels
        # a clip's frames keep the video processor's own bounds unless the engine's were
        # given explicitly (--min-pixels / --max-pixels)
        video = getattr(self.processor, "video_processor", None)
        vsize = video.size if video is not None else size
        self.video_min_pixels = int(vsize["shortest_edge"]) if min_pixels is None else min_pixels
        self.video_max_pixels = int(vsize["longest_edge"]) if max_pixels is None else max_pixels
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
        check_mm_processor_kwargs(mm_processor_kwargs)  # refused before the template runs
        hf_messages, media = _split_messages(messages)
        images = [src for kind, src in media if kind == "image"]
        videos = [src for kind, src in media if kind == "video"]
        # the generation prompt by default; /tokenize may turn it off (chat_template_kwargs)
        template_kwargs = {"add_generation_prompt": True, **(chat_template_kwargs or {})}
        text = self.processor.apply_chat_template(hf_messages, tokenize=False, **template_kwargs)
        return self.process_prompt(text, images, mm_processor_kwargs, videos)

    def process_prompt(
        self,
        prompt: str,
        images: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        videos: list[Any] | None = None,
    ) -> ProcessedPrompt:
        """A raw prompt (no chat template). Images and videos need their placeholders in the
        text; a video is a :class:`VideoSource` or a plain list of frames."""
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        overrides = check_mm_processor_kwargs(mm_processor_kwargs)
        size = self._image_size(overrides, self.min_pixels, self.max_pixels)
        loaded = [self._load(src, n) for n, src in enumerate(images or [])]
        clips = [self._load_video(src, n) for n, src in enumerate(videos or [])]
        video_size = (
            self._image_size(overrides, self.video_min_pixels, self.video_max_pixels)
            if clips
            else None
        )
        return self._process(prompt, loaded, size, clips, video_size)

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
                vids = mm.get("video") or []
                if isinstance(vids, VideoSource) or (vids and not _is_clip_list(vids)):
                    vids = [vids]  # one clip given as a bare list of frames
                return self.process_prompt(
                    inputs["prompt"],
                    imgs if isinstance(imgs, list) else [imgs],
                    mm_kwargs,
                    vids,
                )
        raise InvalidRequestError(f"unsupported prompt type {type(inputs).__name__}")

    # ---- internals ------------------------------------------------------------------------
    def _load(self, source: Any, index: int) -> Image.Image:
        try:
            return load_image(source)
        except InvalidImageError as exc:
            raise InvalidImageError(f"image {index}: {exc}", param=exc.param) from None

    def _load_video(self, source: Any, index: int) -> tuple[list[Image.Image], float | None]:
        """A clip's frames as RGB images of one size (the video processor stacks them)."""
        clip = source if isinstance(source, VideoSource) else VideoSource(list(source))
        if not clip.frames:
            raise InvalidRequestError(f"video {index} has no frames")
        frames = []
        for k, src in enumerate(clip.frames):
            try:
                frames.append(load_image(src))
            except InvalidImageError as exc:
                raise InvalidImageError(f"video {index} frame {k}: {exc}", exc.param) from None
        sizes = {f.size for f in frames}
        if len(sizes) > 1:
            raise InvalidImageError(
                f"video {index}: all frames must have one size, got {sorted(sizes)}"
            )
        return frames, clip.fps

    def _image_size(self, overrides: dict[str, int], lo: int, hi: int) -> dict[str, int]:
        """The processor's ``size`` for one request: the engine's bounds, with the request's
        ``mm_processor_kwargs`` (validated by :func:`check_mm_processor_kwargs`, so the
        offline API and the server refuse the same things) on top."""
        lo = overrides.get("min_pixels", lo)
        hi = overrides.get("max_pixels", hi)
        if lo > hi:
            raise InvalidRequestError(
                f"mm_processor_kwargs: min_pixels {lo} > max_pixels {hi} (a bound not given "
                "is the server's)",
                param="mm_processor_kwargs",
            )
        return {"shortest_edge": lo, "longest_edge": hi}

    def _process(
        self,
        text: str,
        images: list[Image.Image],
        size: dict[str, int],
        videos: list[tuple[list[Image.Image], float | None]] | None = None,
        video_size: dict[str, int] | None = None,
    ) -> ProcessedPrompt:
        if self.length_guard is not None:
            self.length_guard.check(text)
        # ``size`` goes to the image processor only (transformers 5 spelling of the bounds)
        kwargs: dict[str, Any] = {"images_kwargs": {"size": size}} if images else {}
        if videos:
            if self.video_token_id is None:
                raise InvalidRequestError("this checkpoint takes no video input")
            kwargs["videos_kwargs"] = self._videos_kwargs(videos, video_size)
        try:
            enc = self.processor(
                text=[text],
                images=images or None,
                videos=[frames for frames, _ in videos] if videos else None,
                return_tensors="pt",
                **kwargs,
            )
        except InvalidRequestError:
            raise
        except (ValueError, IndexError) as exc:  # e.g. placeholder count != image count
            raise InvalidRequestError(f"cannot process prompt: {exc}") from None
        ids = enc["input_ids"][0].tolist()
        mm = {
            "image": (enc.get("pixel_values"), enc.get("image_grid_thw"), None),
            "video": (
                enc.get("pixel_values_videos"),
                enc.get("video_grid_thw"),
                enc.get("second_per_grid_ts"),
            ),
        }
        return self._from_ids(text, ids, images, mm)

    @staticmethod
    def _videos_kwargs(videos, video_size) -> dict[str, Any]:
        """The video processor's arguments: the frame size bounds and, where the caller knows
        the rate its frames were sampled at, that rate (it sets Qwen2.5-VL's seconds per
        temporal patch; without it the processor assumes 24 fps, as ``transformers`` does)."""
        from transformers.video_utils import VideoMetadata

        out: dict[str, Any] = {"size": video_size}
        if any(fps is not None for _, fps in videos):
            out["video_metadata"] = [
                VideoMetadata(total_num_frames=len(frames), fps=fps) for frames, fps in videos
            ]
        return out

    def _from_ids(self, text, ids: list[int], images, mm) -> ProcessedPrompt:
        if not ids:
            raise EmptyPromptError("prompt is empty (tokenises to zero tokens)", param="messages")
        mm = mm or {}
        items = self._media_items(ids, "image", self.image_token_id, mm.get("image"))
        if self.video_token_id is not None:
            items += self._media_items(ids, "video", self.video_token_id, mm.get("video"))
        items.sort(key=lambda item: item.offset)
        positions, delta = mrope_positions(ids, items, self.spatial_merge_size)
        return ProcessedPrompt(text, ids, positions, delta, items)

    def _media_items(self, ids: list[int], kind: str, token_id: int, mm) -> list[ImageInput]:
        """One item per placeholder run of ``token_id``, with its slice of the pixels."""
        runs = _placeholder_runs(ids, token_id)
        if not runs:
            return []
        pixels, grids, seconds = mm if mm else (None, None, None)
        if grids is None or len(grids) != len(runs):
            raise InvalidRequestError(
                f"prompt has {len(runs)} {kind} placeholder runs but "
                f"{0 if grids is None else len(grids)} {kind}s"
            )
        patch_counts = grids.prod(-1).tolist()
        offsets = [0, *itertools.accumulate(patch_counts)]
        merge = self.spatial_merge_size**2
        items = []
        for k, (start, length) in enumerate(runs):
            grid = tuple(int(x) for x in grids[k].tolist())
            px = pixels[offsets[k] : offsets[k + 1]].contiguous()
            if length != patch_counts[k] // merge:
                raise InvalidRequestError(
                    f"{kind} {k}: {length} placeholder tokens but the {kind} has "
                    f"{patch_counts[k] // merge} embeddings"
                )
            digest = hashlib.sha256(px.numpy().tobytes())
            digest.update(repr(grid).encode())
            step = 1.0
            if kind == "video" and self.tokens_per_second is not None:
                # float32 as in transformers: tokens_per_second * second_per_grid_ts[k]
                secs = seconds[k] if seconds is not None else torch.tensor(1.0)
                step = float(self.tokens_per_second * secs.to(torch.float32))
            items.append(
                ImageInput(digest.hexdigest(), start, length, px, grid, kind, temporal_step=step)
            )
        return items


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


def _is_clip_list(videos: Any) -> bool:
    """``multi_modal_data["video"]`` as a list of clips (not one clip's list of frames)."""
    return isinstance(videos, list) and all(
        isinstance(v, VideoSource | list | tuple) for v in videos
    )


def mrope_positions(
    ids: list[int], images: list[ImageInput], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """Qwen2-VL 3-D positions: text advances all axes by one; an image's or clip's tokens take
    (t, row, col) offsets from the position where it starts, and the text after it resumes at
    ``start + max(rows, cols)`` (whatever the clip's length: transformers' ``get_rope_index``).
    A clip's temporal offset of patch ``i`` is ``int(i * temporal_step)`` in float32.
    Returns positions [3, len(ids)] and the delta for generated tokens
    (``position = index + delta``; from the largest position, which a clip's t may set)."""
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
        steps = torch.arange(t)
        if im.temporal_step != 1.0:
            steps = (steps * torch.tensor(im.temporal_step, dtype=torch.float32)).long()
        tt, hh, ww = torch.meshgrid(steps, torch.arange(h), torch.arange(w), indexing="ij")
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
