"""Typed configuration for the camera pipeline and the describers.

One YAML file drives both processes (``vision-serve pipeline`` and ``vision-serve
describe``), so they agree on stream names and per-camera prompts. Every section is a
pydantic model with defaults; unknown keys are rejected so a typo is an error that names the
field, not a silently ignored setting. Environment variables override the file (for compose
and secrets): ``VS_`` + the field path joined by ``__``, e.g. ``VS_REDIS_URL``,
``VS_DESCRIBER__BASE_URL``, ``VS_DESCRIBER__API_KEY``, ``VS_DETECTOR__DEVICE``; a list
such as ``VS_CAMERAS`` is given as JSON.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pipelines.events.config import EventsConfig, UIConfig
from pipelines.notify.config import NotifyConfig

ENV_PREFIX = "VS_"
CAMERA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
URL_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "file", "udp", "tcp", "srt")


class ConfigError(ValueError):
    """A configuration a person must fix; the message names the file and the field."""


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DetectorOverrides(Section):
    """Per-camera changes to the detector (the model itself is shared, for batching)."""

    conf: float | None = Field(None, ge=0.0, le=1.0)
    imgsz: int | None = Field(None, ge=32, le=4096)
    classes: list[int] | None = None


class CameraConfig(Section):
    """One camera. ``url``: rtsp://..., a video file path, or a device index (int)."""

    id: str
    url: str | int
    fps: float = Field(2.0, gt=0.0, le=60.0, description="frames per second to sample")
    prompt: str | None = None
    detector: DetectorOverrides = Field(default_factory=DetectorOverrides)
    realtime: bool = Field(
        True, description="files: play at their own frame rate, like a live camera"
    )
    loop: bool = Field(True, description="files: start again at the end")

    @field_validator("id")
    @classmethod
    def _id_is_a_key(cls, value: str) -> str:
        # ids become Redis key parts and Prometheus labels: keep them plain
        if not CAMERA_ID.match(value):
            raise ValueError("use 1-64 of letters, digits, '_', '.', '-' (start alphanumeric)")
        return value

    @field_validator("url")
    @classmethod
    def _url_is_a_source(cls, value: str | int) -> str | int:
        if isinstance(value, int):
            if value < 0:
                raise ValueError("a device index must be >= 0")
            return value
        value = value.strip()
        if not value:
            raise ValueError("must not be empty")
        if value.isdigit():
            return int(value)
        if "://" in value:
            scheme = value.split("://", 1)[0].lower()
            if scheme not in URL_SCHEMES:
                raise ValueError(f"unsupported scheme {scheme!r}; use one of {URL_SCHEMES}")
        return value

    @property
    def is_file(self) -> bool:
        """A local video file (paced and looped here), as opposed to a live stream or device."""
        return isinstance(self.url, str) and ("://" not in self.url or self.url.startswith("file:"))


class IngestConfig(Section):
    """How cameras are opened and re-opened."""

    ffmpeg_options: str = Field(
        "rtsp_transport;tcp|analyzeduration;500000",
        description="OPENCV_FFMPEG_CAPTURE_OPTIONS: RTSP over TCP, short stream probe",
    )
    open_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(5.0, gt=0)
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)


class DetectorConfig(Section):
    """The shared YOLO model. ``weights`` ending in ``.yaml`` builds an untrained model."""

    weights: str = "yolo26n.pt"
    conf: float = Field(0.25, ge=0.0, le=1.0)
    imgsz: int = Field(640, ge=32, le=4096)
    classes: list[int] = Field(default_factory=lambda: [0], description="COCO 0 = person")
    device: str = "cpu"
    max_batch: int = Field(16, ge=1, le=256)


class GateConfig(Section):
    """Which detected frames are worth a description."""

    min_persons: int = Field(1, ge=0, description="0 sends frames without people too")
    cooldown_s: float = Field(10.0, ge=0, description="at most one frame per camera per cooldown")
    send_on_change: bool = Field(True, description="a change of person count skips the cooldown")
    min_interval_s: float = Field(1.0, ge=0, description="floor between two frames of a camera")


class QueueConfig(Section):
    """Redis keys and bounds. Streams hold metadata; each JPEG is its own key with a TTL."""

    frames_stream: str = "vs:frames"
    group: str = "describers"
    descriptions_stream: str = "vs:descriptions"
    dead_letter_stream: str = "vs:frames:dead"
    latest_prefix: str = "vs:latest:"
    image_prefix: str = "vs:frame:"
    stats_key: str = "vs:stats"
    maxlen: int = Field(
        1000, ge=10, description="undelivered frames the stream holds (more are refused)"
    )
    descriptions_maxlen: int = Field(10000, ge=10)
    dead_letter_maxlen: int = Field(10000, ge=10)
    image_ttl_s: int = Field(300, ge=1)
    max_frame_age_s: float = Field(60.0, gt=0, description="older frames expire unsent")
    jpeg_quality: int = Field(85, ge=10, le=100)
    max_image_side: int = Field(1280, ge=64, description="larger frames are downscaled")
    local_buffer: int = Field(64, ge=1, description="frames held while Redis is unreachable")
    dedupe_prefix: str = "vs:enqueued:"
    producer_prefix: str = "vs:producer:"
    camera_prefix: str = Field(
        "vs:camera:",
        description="<camera_prefix><camera id>: the pipeline's live numbers for the camera, "
        "refreshed every heartbeat_s, expiring after three (a stopped pipeline's go offline)",
    )
    instance: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$",
        description="this pipeline's name in <producer_prefix><instance> (default: the "
        "hostname); one running pipeline per name, kept across its restarts",
    )
    heartbeat_s: float = Field(
        1.0,
        gt=0,
        description="how often the pipeline records its locally buffered frames and its "
        "cameras' live numbers",
    )
    producer_ttl_s: int = Field(
        86400, ge=1, description="how long a stopped pipeline's record waits for its restart"
    )


class DescriberConfig(Section):
    """The OpenAI-compatible endpoint and how workers use it."""

    base_url: str = "http://127.0.0.1:8000/v1"
    api_key: str = "EMPTY"
    model: str | None = None
    prompt: str = "Describe the people in this camera frame and what they are doing, briefly."
    max_pixels: int | None = Field(
        None,
        ge=1,
        description="frames are downscaled to at most this many pixels before sending (image "
        "tokens scale with pixels); None sends them as queued",
    )
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    timeout_s: float = Field(60.0, gt=0)
    retries: int = Field(2, ge=0, le=10, description="SDK retries per attempt")
    concurrency: int = Field(4, ge=1, le=256)
    priority: str | int | None = Field("batch", description="sent as extra_body priority")
    send_deadline: bool = Field(
        True,
        description="send the frame's remaining age as extra_body max_queue_seconds, so the "
        "server drops it unstarted once stale (vision-serve and vLLM-style servers accept it)",
    )
    block_ms: int = Field(1000, ge=10, le=60000)
    claim_idle_s: float = Field(30.0, gt=0, description="pending this long = worker is dead")
    claim_interval_s: float = Field(5.0, gt=0)
    max_deliveries: int = Field(5, ge=1, description="then the frame goes to the dead letters")
    max_failures: int = Field(
        3, ge=1, description="server errors (HTTP 500...) one frame may get, then it is dead"
    )
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)
    shutdown_grace_s: float = Field(10.0, ge=0)
    consumer_gc_s: float = Field(3600.0, gt=0, description="forget idle consumers with nothing")


class MetricsConfig(Section):
    """Prometheus endpoints; port 0 disables one."""

    host: str = "0.0.0.0"
    pipeline_port: int = Field(9101, ge=0, le=65535)
    describe_port: int = Field(9102, ge=0, le=65535)


def redacted_redis_url(url: str) -> str:
    """``url`` fit for a log line or an error message: password (and any ``password=``
    query value) replaced by ``***``; a URL too broken to tell where its password ends is
    shown as ``scheme://***``."""
    from urllib.parse import urlsplit

    scheme = url.partition("://")[0] if "://" in url else "redis"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        return f"{scheme}://***"
    if "@" in url and "@" not in parts.netloc:  # a '/', '?' or '#' in the password
        return f"{scheme}://***"
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # user-only userinfo may be a password given without the ':' (redis://secret@host)
        url = url.replace(parts.netloc, f"{user}:***@{host}" if colon else f"***@{host}", 1)
    base, question, rest = url.partition("?")
    query, hash_, fragment = rest.partition("#")
    pairs = [
        p.partition("=")[0] + "=***" if "password" in p.lower() else p for p in query.split("&")
    ]
    return base + question + "&".join(pairs) + hash_ + fragment


class PipelineConfig(BaseSettings):
    """The whole file."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    redis_url: str = "redis://127.0.0.1:6379/0"
    cameras: list[CameraConfig] = Field(default_factory=list)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    detector: DetectorConfig = Field(default_factory=DetectorConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    describer: DescriberConfig = Field(default_factory=DescriberConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    ui: UIConfig = Field(default_factory=UIConfig)
    notify: NotifyConfig = Field(default_factory=NotifyConfig)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # environment first: it overrides the YAML file (passed as init values)
        return (env_settings, init_settings)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        # the messages never repeat the URL: it may carry a password
        from urllib.parse import urlsplit

        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        if value.startswith("unix://"):
            return value
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            parts = None
        if parts is None or not parts.hostname:
            raise ValueError(
                "no host[:port] found; a password with '/', '?', '#' or '%' must be "
                "percent-encoded (or use one of letters and digits: openssl rand -hex 32)"
            )
        return value

    @model_validator(mode="after")
    def _unique_camera_ids(self) -> PipelineConfig:
        seen: set[str] = set()
        for camera in self.cameras:
            if camera.id in seen:
                raise ValueError(f"cameras: duplicate camera id {camera.id!r}")
            seen.add(camera.id)
        return self

    def camera(self, camera_id: str) -> CameraConfig | None:
        """The camera with this id, if configured (describers use it for the prompt)."""
        return next((c for c in self.cameras if c.id == camera_id), None)

    def prompt_for(self, camera_id: str) -> str:
        """Per-camera prompt if set, else the describer's."""
        camera = self.camera(camera_id)
        return camera.prompt if camera and camera.prompt else self.describer.prompt


def _describe_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        if err["loc"] and err["loc"][-1] == "redis_url" and isinstance(got, str):
            got = redacted_redis_url(got)  # never echo a password into logs
        shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
        lines.append(f"  {where}: {err['msg']}{shown}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "<config>") -> PipelineConfig:
    """Validate a config mapping (plus ``VS_*`` env overrides); ConfigError names each field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return PipelineConfig(**data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid configuration\n{_describe_errors(exc)}") from None


def load_config(path: str | Path) -> PipelineConfig:
    """Read and validate a YAML config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))
