"""One frame -> one chat completion, through the ``openai`` SDK.

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
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import math
import time
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
    return prompt + _tracking_note(fields, boxes)


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


async def frame_request(
    config: PipelineConfig, jpeg: bytes, fields: dict[str, str]
) -> tuple[bytes, str]:
    """What is sent for a frame: its JPEG (``fit_frame`` to ``describer.max_pixels`` when set,
    off the event loop: decoding and resizing take milliseconds) and the prompt for its camera,
    listing the detections in the sent image's coordinates."""
    max_pixels = config.describer.max_pixels
    prompt_fields = fields
    if max_pixels:
        jpeg, prompt_fields = await asyncio.to_thread(
            fit_frame, jpeg, fields, max_pixels, config.queue.jpeg_quality
        )
    camera = fields.get("camera", "?")
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
        self.client = openai.AsyncOpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key if endpoint.api_key is not None else cfg.api_key,
            timeout=cfg.timeout_s,
            max_retries=cfg.retries,
        )

    async def describe(
        self,
        jpeg: bytes,
        prompt: str,
        deadline_s: float | None = None,
        response_schema: dict[str, Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The description text and request facts (model, tokens, seconds). ``deadline_s``:
        seconds the server may keep the frame waiting before it is stale (sent when
        ``send_deadline``); the server then answers 408 instead of describing it late.
        ``response_schema``: the answer is JSON valid against it (OpenAI's strict
        ``json_schema`` response format, which vLLM and our server enforce)."""
        url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")
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
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": prompt},
                        ],
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
            "vlm_seconds": time.monotonic() - started,
        }

    async def close(self) -> None:
        await self.client.close()
