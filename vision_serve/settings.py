"""Server settings (everything that is not an engine argument).

Read from ``VISION_SERVE_<FIELD>`` environment variables so that compose files configure the
server the same way they configure the engine (``engine.config`` uses the same prefix); CLI
flags override the environment. Engine arguments stay in :class:`engine.config.EngineArgs`:
one source of truth per knob.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "VISION_SERVE_"


def _split_csv(value: object) -> object:
    """Accept ``a,b c`` as well as a list, so ``VISION_SERVE_ALLOWED_MEDIA_DOMAINS=a.com,b.org``
    works from a compose file without JSON quoting."""
    if isinstance(value, str):
        return [part for part in value.replace(",", " ").split() if part]
    return value


def _json_or_csv(value: object) -> object:
    """vLLM takes these as JSON lists (``--allowed-origins '["https://a.com"]'``); accept that
    verbatim, as well as ``a,b`` and repeated values, so vLLM command lines work unchanged."""
    items = value if isinstance(value, list) else [value]
    out: list[object] = []
    for item in items:
        if isinstance(item, str) and item.strip().startswith("["):
            try:
                decoded = json.loads(item)
            except ValueError:
                raise ValueError(f"not a JSON list: {item!r}") from None
            out.extend(decoded if isinstance(decoded, list) else [decoded])
        elif isinstance(item, str):
            out.extend(part for part in item.replace(",", " ").split() if part)
        else:
            out.append(item)
    return out


class ServerSettings(BaseSettings):
    """HTTP-side configuration of ``vision-serve serve``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # Names clients may put in ``model``; the first is reported back. Empty: the checkpoint's
    # directory name (what the engine calls ``model_name``).
    served_model_name: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Bearer token required on /v1/* (None: no auth). /health and /metrics stay open so that
    # orchestrators and Prometheus need no secret.
    api_key: str | None = None
    # http(s) image URLs are refused unless their host is listed here (a subdomain of a listed
    # domain counts). Fetching arbitrary URLs from the server would be an SSRF hole.
    allowed_media_domains: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # A listed name that resolves to loopback/private/link-local addresses is refused unless
    # this is set (a camera NVR on the LAN, say): names are checked, and names can lie.
    allow_private_media_addresses: bool = False
    # file:// image URLs are refused unless they resolve under this directory.
    allowed_local_media_path: Path | None = None
    media_fetch_timeout_s: float = Field(default=5.0, gt=0)
    max_image_bytes: int = Field(default=20 * 1024 * 1024, gt=0)
    # Door limits on images, checked from the file headers before any pixel is decoded, so one
    # request cannot make the server allocate gigabytes (a 50 MB body of PNGs that each
    # declare 89 MP would otherwise decode to ~40 GB). 32 Mpx fits an 8K frame.
    max_images_per_request: int = Field(default=16, ge=0)
    max_image_pixels: int = Field(default=32 * 1024 * 1024, gt=0)
    max_request_pixels: int = Field(default=64 * 1024 * 1024, gt=0)
    # Video parts: frames per clip (a frame list longer than this is refused; a video file is
    # sampled down to it), and the rate frames are taken from a video file. Every frame also
    # counts as an image against the three limits above. A file is bounded by max_image_bytes.
    max_video_frames: int = Field(default=8, ge=1)
    video_fps: float = Field(default=2.0, gt=0)
    # Images decoded at once across all requests; decoding is CPU-bound, more than the cores
    # only adds memory held by half-decoded images.
    max_concurrent_image_decodes: int = Field(default=2, ge=1)
    # Whole request body; base64 images make bodies big, but not unboundedly so.
    max_request_body_mb: float = Field(default=50.0, gt=0)
    # CORS (vLLM's flags and defaults): which browser origins may call the API. "*" is safe
    # here because the API key travels in the Authorization header, which a page must hold
    # and send itself: the browser never attaches it on its own (no cookies), so another site
    # cannot ride on a user's session. Narrow the origins when a browser app should be the only
    # caller; credentials stay off unless a proxy in front authenticates with cookies.
    allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["*"])
    allowed_methods: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["*"])
    allowed_headers: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # Seconds uvicorn waits for in-flight streams on shutdown before cutting them.
    graceful_shutdown_s: float = Field(default=5.0, ge=0)
    log_level: str = "info"
    # One JSON line per finished request on the ``vision_serve.requests`` logger.
    log_requests: bool = True

    @field_validator("api_key")
    @classmethod
    def _key_not_blank(cls, v: str | None) -> str | None:
        """An empty key would accept any ``Bearer`` header: refuse it rather than guess."""
        if v is not None and not v.strip():
            raise ValueError("api_key is empty; omit it to serve without authentication")
        return v

    @field_validator("served_model_name", "allowed_media_domains", mode="before")
    @classmethod
    def _split_lists(cls, v: object) -> object:
        return _split_csv(v)

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _cors_lists(cls, v: object) -> object:
        return _json_or_csv(v)

    @field_validator("allowed_media_domains")
    @classmethod
    def _lower_domains(cls, v: list[str]) -> list[str]:
        return [d.lower().strip(".") for d in v]

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * 1024 * 1024)
