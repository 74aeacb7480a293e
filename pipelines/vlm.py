"""One frame (or one clip) -> one chat completion, through the ``openai`` SDK.

Why the SDK and a data URL: the describers must work against any OpenAI-compatible server
(ours, vLLM, a hosted API) with no extra image hosting; the JPEG travels inline. Camera
requests carry ``priority`` (``batch`` by default) in ``extra_body``, so a server that
schedules by priority serves interactive chat first.

Failures are sorted into three kinds, because they need different handling:
``EndpointUnavailable`` (connection refused, timeout, 408/409/429, 502/503/504, and
401/403/404, which are the endpoint's configuration, not the frame's fault) -- an outage: the
frame waits and is retried until it expires; ``ServerError`` (500 and the other 5xx) -- the
endpoint answers but failed on this frame: retried ``describer.max_failures`` times, then
dead-lettered, because a frame that breaks the server would otherwise be retried until it
expires; ``FrameRejected`` (other 4xx, an empty answer) -- retrying cannot help, the frame
goes to the dead letters at once.

A clip (``describer.view: clip``) goes out in the form the endpoint takes (``clip_format``):
``frames`` -- one ``{"type": "video", "video": [data URL, ...], "fps": ...}`` part (our
server; Qwen's own API shape); ``video_url`` -- one MP4 (OpenCV, ``mp4v``) as a
``data:video/mp4`` URL (vLLM); ``images`` -- one ``image_url`` part per frame, for servers
without video input (llama.cpp's). The prompt says it is a clip either way.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import openai

from pipelines import metrics
from pipelines.config import DescriberConfig, EndpointConfig, PipelineConfig


class EndpointUnavailable(Exception):
    """The endpoint cannot answer now; the frame should wait and be retried."""


class ServerError(Exception):
    """The endpoint answered this frame with a server error; a few retries, then give up."""


class FrameRejected(Exception):
    """The endpoint refused this frame; retrying will not help."""


# statuses that say the endpoint (or the way to it) is down or misconfigured, not the frame
OUTAGE_STATUS = {401, 403, 404, 408, 409, 429, 502, 503, 504}


@dataclass(frozen=True)
class ClipMedia:
    """A clip to send: its JPEGs, oldest first, and the rate they were taken at."""

    frames: tuple[bytes, ...]
    fps: float | None = None


def split_clip(blob: bytes, sizes: str) -> tuple[bytes, ...]:
    """The JPEGs of a clip key (``queue.encode_clip``); ValueError when the lengths in
    ``clip_sizes`` do not add up to the blob."""
    try:
        lengths = [int(n) for n in sizes.split(",")]
    except ValueError:
        raise ValueError(f"clip_sizes is not a list of lengths: {sizes[:80]!r}") from None
    if not lengths or any(n <= 0 for n in lengths) or sum(lengths) != len(blob):
        raise ValueError(f"clip_sizes {sizes[:80]!r} do not match a {len(blob)}-byte clip")
    out, at = [], 0
    for n in lengths:
        out.append(blob[at : at + n])
        at += n
    return tuple(out)


def clip_fps(fields: dict[str, str], frames: int) -> float | None:
    """The clip's frame rate from ``clip_seconds`` (None for a single frame or no span)."""
    try:
        seconds = float(fields.get("clip_seconds") or 0)
    except ValueError:
        return None
    return round((frames - 1) / seconds, 3) if frames > 1 and seconds > 0 else None


def encode_mp4(frames: tuple[bytes, ...], fps: float | None) -> bytes:
    """The clip as an MP4 (MPEG-4 part 2, ``mp4v``: in every OpenCV build) at ``fps``
    (1 when unknown). OpenCV writes to a path only: a temporary file, removed after."""
    images = [cv2.imdecode(np.frombuffer(j, np.uint8), cv2.IMREAD_COLOR) for j in frames]
    if not images or any(i is None for i in images):
        raise ValueError("a clip frame does not decode")
    height, width = images[0].shape[:2]
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps or 1.0, (width, height))
        if not writer.isOpened():
            raise ValueError("OpenCV cannot write mp4v video here")
        for image in images:
            if image.shape[:2] != (height, width):
                image = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
            writer.write(image)
        writer.release()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


async def media_parts(media: bytes | ClipMedia, clip_format: str) -> list[dict[str, Any]]:
    """The content parts showing ``media``: one image, or a clip in ``clip_format``."""
    if isinstance(media, bytes):
        return [{"type": "image_url", "image_url": {"url": _data_url("image/jpeg", media)}}]
    urls = [_data_url("image/jpeg", j) for j in media.frames]
    if clip_format == "images":
        return [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    if clip_format == "video_url":
        mp4 = await asyncio.to_thread(encode_mp4, media.frames, media.fps)
        return [{"type": "video_url", "video_url": {"url": _data_url("video/mp4", mp4)}}]
    part: dict[str, Any] = {"type": "video", "video": urls}
    if media.fps:
        part["fps"] = media.fps
    return [part]


def build_prompt(base: str, fields: dict[str, str]) -> str:
    """The instruction plus what the pipeline knows: camera, time, and the detections."""
    ts = float(fields.get("ts", "0") or 0)
    when = dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    try:
        boxes = json.loads(fields.get("boxes", "[]"))
    except json.JSONDecodeError:
        boxes = []
    size = f"{fields.get('width', '?')}x{fields.get('height', '?')}"
    if boxes:
        listed = "; ".join(
            f"{b.get('label', 'object')}{_track_tag(b)} {float(b.get('conf', 0)):.2f} at "
            f"[{', '.join(str(round(v)) for v in b.get('box', []))}]"
            for b in boxes
        )
        detections = f"{len(boxes)} detection(s) (x1, y1, x2, y2 in a {size} image): {listed}"
    else:
        detections = "no detections"
    camera = fields.get("camera", "?")
    prompt = f"{base}\nCamera: {camera}. Captured: {when}. Detector: {detections}."
    return prompt + _clip_note(fields) + _tracking_note(fields, boxes)


def _clip_note(fields: dict[str, str]) -> str:
    """For a clip: how many frames over how long, and where each triggering track went."""
    sizes = fields.get("clip_sizes")
    if not sizes:
        return ""
    count = len(sizes.split(","))
    try:
        seconds = float(fields.get("clip_seconds") or 0)
    except ValueError:
        seconds = 0.0
    note = (
        f"\nYou are shown a clip: {count} frames over {seconds:.1f} s, oldest first; the "
        "capture time and the detections above are those of its last frame."
    )
    try:
        paths = json.loads(fields.get("clip_tracks", "{}"))
    except json.JSONDecodeError:
        paths = {}
    if isinstance(paths, dict) and paths:
        listed = "; ".join(
            f"{p.get('label', 'object')} #{tid} from [{_box_text(p.get('first'))}] to "
            f"[{_box_text(p.get('last'))}] (in {p.get('frames', '?')} of {count} frames)"
            for tid, p in paths.items()
            if isinstance(p, dict)
        )
        note += f"\nOver the clip: {listed}."
    return note


def _box_text(box: Any) -> str:
    try:
        return ", ".join(str(round(float(v))) for v in box)
    except (TypeError, ValueError):
        return "?"


def _tracking_note(fields: dict[str, str], boxes: list[dict[str, Any]]) -> str:
    """What per-track gating and crops add (nothing for entries without them): which
    tracks the description is for and why, and that the image is part of the frame."""
    note = ""
    if fields.get("crop"):
        full = f"{fields.get('frame_width', '?')}x{fields.get('frame_height', '?')}"
        note += f"\nThe image is the region {fields['crop']} of the {full} camera frame."
    try:
        wanted = set(json.loads(fields.get("tracks", "[]")))
    except (json.JSONDecodeError, TypeError):
        wanted = set()
    tracked = [b for b in boxes if b.get("track_id") in wanted]
    if tracked:
        listed = "; ".join(
            f"{b.get('label', 'object')} #{b['track_id']} at "
            f"[{', '.join(str(round(v)) for v in b.get('box', []))}]"
            for b in tracked
        )
        event = {"track_end": "last seen", "track_interval": "still here"}.get(
            fields.get("gate", ""), "new"
        )
        note += f"\nTracked ({event}): {listed}."
    return note


def _track_tag(box: dict[str, Any]) -> str:
    return f" #{box['track_id']}" if box.get("track_id") is not None else ""


def fit_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """The largest size with ``w * h <= max_pixels`` and (up to rounding) the same aspect ratio."""
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    w, h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    if w * h > max_pixels:  # a side held at 1 px, or float rounding: trim the longer side
        if w >= h:
            w = max(1, max_pixels // h)
        else:
            h = max(1, max_pixels // w)
    return w, h


def fit_frame(
    jpeg: bytes, fields: dict[str, str], max_pixels: int, quality: int
) -> tuple[bytes, dict[str, str]]:
    """Downscale a frame to at most ``max_pixels`` pixels before it is sent.

    Why on the client: image tokens (the bulk of a frame's prompt and cost) scale with pixels,
    and doing it here works against any OpenAI-compatible endpoint, ours or not; it also
    shrinks the upload. Returns the JPEG to send and ``fields`` with ``width``, ``height`` and
    ``boxes`` in the sent image's coordinates, since the prompt lists the detections in them. A
    frame that already fits, or that does not decode (the endpoint judges it), is sent as is.
    """
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        return jpeg, fields
    height, width = image.shape[:2]
    w, h = fit_size(width, height, max_pixels)
    if (w, h) == (width, height):
        return jpeg, fields
    small = cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", small, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        return jpeg, fields
    sx, sy = w / width, h / height
    try:
        boxes = json.loads(fields.get("boxes", "[]"))
        for b in boxes:
            x1, y1, x2, y2 = b["box"]
            b["box"] = [round(x1 * sx, 1), round(y1 * sy, 1), round(x2 * sx, 1), round(y2 * sy, 1)]
        scaled = json.dumps(boxes, separators=(",", ":"))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        scaled = "[]"  # as build_prompt treats unreadable boxes
    return buf.tobytes(), {**fields, "width": str(w), "height": str(h), "boxes": scaled}


def fit_clip(
    frames: tuple[bytes, ...], fields: dict[str, str], max_pixels: int, quality: int
) -> tuple[tuple[bytes, ...], dict[str, str]]:
    """``fit_frame`` for every frame of a clip (they share one size); ``fields`` as the last
    frame's fit gives them, with ``clip_tracks`` scaled alike."""
    fitted = [fit_frame(j, fields, max_pixels, quality) for j in frames]
    out = fitted[-1][1]
    try:
        w0, w1 = float(fields.get("width") or 0), float(out.get("width") or 0)
        h0, h1 = float(fields.get("height") or 0), float(out.get("height") or 0)
        paths = json.loads(fields.get("clip_tracks", "{}"))
        if w0 and h0 and (w0, h0) != (w1, h1) and isinstance(paths, dict):
            sx, sy = w1 / w0, h1 / h0
            for p in paths.values():
                for key in ("first", "last"):
                    x1, y1, x2, y2 = p[key]
                    p[key] = [round(x1 * sx, 1), round(y1 * sy, 1), round(x2 * sx, 1),
                              round(y2 * sy, 1)]  # fmt: skip
            out = {**out, "clip_tracks": json.dumps(paths, separators=(",", ":"))}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        out = {**out, "clip_tracks": "{}"}
    return tuple(j for j, _ in fitted), out


async def frame_request(
    config: PipelineConfig,
    jpeg: bytes,
    fields: dict[str, str],
    clip: tuple[bytes, ...] | None = None,
) -> tuple[bytes | ClipMedia, str]:
    """What is sent for a frame: its JPEG -- or for a clip, its frames as ``ClipMedia`` --
    (``fit_frame`` to ``describer.max_pixels`` when set, off the event loop: decoding and
    resizing take milliseconds) and the prompt for its camera, listing the detections in the
    sent image's coordinates."""
    max_pixels = config.describer.max_pixels
    quality = config.queue.jpeg_quality
    prompt_fields = fields
    camera = fields.get("camera", "?")
    if clip is not None:
        if max_pixels:
            clip, prompt_fields = await asyncio.to_thread(
                fit_clip, clip, fields, max_pixels, quality
            )
        media = ClipMedia(clip, clip_fps(fields, len(clip)))
        return media, build_prompt(config.prompt_for(camera), prompt_fields)
    if max_pixels:
        jpeg, prompt_fields = await asyncio.to_thread(fit_frame, jpeg, fields, max_pixels, quality)
    return jpeg, build_prompt(config.prompt_for(camera), prompt_fields)


class VLMClient:
    """Async chat-completions client for frame descriptions, to one endpoint (``endpoint``,
    default the first of ``cfg.endpoint_list()``); its ``api_key`` / ``model`` default to
    the describer's."""

    def __init__(self, cfg: DescriberConfig, endpoint: EndpointConfig | None = None) -> None:
        endpoint = endpoint or cfg.endpoint_list()[0]
        self.model = endpoint.model or cfg.model
        if not self.model:
            raise ValueError("describer.model is required (the served model's name)")
        self.cfg = cfg
        self.endpoint = endpoint
        self.clip_format = endpoint.clip_format or cfg.clip_format
        self.client = openai.AsyncOpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key if endpoint.api_key is not None else cfg.api_key,
            timeout=cfg.timeout_s,
            max_retries=cfg.retries,
        )

    async def describe(
        self,
        media: bytes | ClipMedia,
        prompt: str,
        deadline_s: float | None = None,
        response_schema: dict[str, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The description text and request facts (model, tokens, seconds). ``deadline_s``:
        seconds the server may keep the frame waiting before it is stale (sent when
        ``send_deadline``); the server then answers 408 instead of describing it late.
        ``response_schema``: the answer is JSON valid against it (OpenAI's strict
        ``json_schema`` response format, which vLLM and our server enforce). ``media``: a
        frame's JPEG, or a clip (sent as this endpoint's ``clip_format``)."""
        try:
            parts = await media_parts(media, self.clip_format)
        except ValueError as exc:
            raise FrameRejected(f"clip not encodable: {exc}") from exc
        extra_body: dict[str, Any] = {}
        structured: dict[str, Any] = {}
        if response_schema is not None:
            structured["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "camera_event", "schema": response_schema, "strict": True},
            }
        if self.cfg.priority is not None:
            extra_body["priority"] = self.cfg.priority
        if self.cfg.send_deadline and deadline_s is not None:
            extra_body["max_queue_seconds"] = round(max(deadline_s, 0.001), 3)
        started = time.monotonic()
        try:
            response = await self.client.chat.completions.create(
                model=self.model,
                messages=[
                    {
                        "role": "user",
                        "content": [*parts, {"type": "text", "text": prompt}],
                    }
                ],
                max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature,
                extra_body=extra_body,
                **structured,
            )
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:
            metrics.VLM_ERRORS.labels("unreachable").inc()
            raise EndpointUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except openai.APIStatusError as exc:
            status = exc.status_code
            metrics.VLM_ERRORS.labels(f"http_{status}").inc()
            if status in OUTAGE_STATUS:
                raise EndpointUnavailable(f"HTTP {status}: {exc.message}") from exc
            if status >= 500:
                raise ServerError(f"HTTP {status}: {exc.message}") from exc
            raise FrameRejected(f"HTTP {status}: {exc.message}") from exc
        finally:
            metrics.VLM_SECONDS.observe(time.monotonic() - started)
        if not response.choices:
            metrics.VLM_ERRORS.labels("no_choices").inc()
            raise FrameRejected("answer without choices")
        usage = response.usage
        # an empty text is still the model's answer for this frame: stored, not retried
        return (response.choices[0].message.content or "").strip(), {
            "model": response.model or self.model,
            "completion_tokens": getattr(usage, "completion_tokens", 0) or 0,
            "prompt_tokens": getattr(usage, "prompt_tokens", 0) or 0,
            "vlm_seconds": time.monotonic() - started,
        }

    async def close(self) -> None:
        await self.client.close()
