"""Config sections of ``vision-serve ui``: the event store (``events:``) and the page (``ui:``).

Registered in ``PipelineConfig`` (``pipelines/config.py``), so they live in the same YAML file
as the cameras and take the same ``VS_`` environment overrides: ``VS_UI__API_KEY``,
``VS_EVENTS__DATA_DIR``, ``VS_EVENTS__RETAIN_DAYS``. This module imports nothing from
``pipelines.config`` at import time (that module imports this one).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    """Unknown keys are errors (a typo names the field), values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CameraRetention(_Section):
    """One camera's retention, overriding the ``events`` defaults; unset fields inherit."""

    retain_days: float | None = Field(None, gt=0)
    max_snapshot_mb: float | None = Field(None, gt=0)


class EventsConfig(_Section):
    """Where descriptions become events: the consumer group, the data dir, retention."""

    data_dir: str = Field(
        "./data/events", description="events.db (SQLite) and snapshots/<camera>/<day>/"
    )
    group: str = Field(
        "events",
        description="consumer group on queue.descriptions_stream; one ui per group (each "
        "counts gaps in the entries it reads as lost:trimmed_unread)",
    )
    consumer: str = Field(
        "ui",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$",
        description="this process's name in the group; keep it across restarts, so a "
        "restarted ui finds and finishes its own pending entries",
    )
    batch: int = Field(64, ge=1, le=1000, description="descriptions read (and acked) at once")
    block_ms: int = Field(1000, ge=10, le=60000)
    claim_idle_s: float = Field(
        60.0, gt=0, description="pending this long under another consumer name: taken over"
    )
    claim_interval_s: float = Field(30.0, gt=0)
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)
    snapshots: bool = Field(True, description="store the raw JPEG and one with boxes drawn")
    jpeg_quality: int = Field(85, ge=10, le=100, description="of the snapshot with boxes")
    retain_days: float | None = Field(
        30.0, gt=0, description="events older than this (capture time) are deleted; null: kept"
    )
    max_snapshot_mb: float | None = Field(
        2048.0, gt=0, description="per camera; past it the oldest events go; null: no budget"
    )
    cameras: dict[str, CameraRetention] = Field(
        default_factory=dict, description="per-camera retain_days / max_snapshot_mb"
    )
    retention_interval_s: float = Field(60.0, gt=0, description="how often retention runs")

    @field_validator("cameras")
    @classmethod
    def _camera_ids(cls, value: dict[str, CameraRetention]) -> dict[str, CameraRetention]:
        from pipelines.config import CAMERA_ID

        for camera in value:
            if not CAMERA_ID.match(camera):
                raise ValueError(f"{camera!r}: not a camera id")
        return value

    def retain_days_for(self, camera: str) -> float | None:
        override = self.cameras.get(camera)
        if override is not None and override.retain_days is not None:
            return override.retain_days
        return self.retain_days

    def max_snapshot_bytes_for(self, camera: str) -> int | None:
        override = self.cameras.get(camera)
        mb = self.max_snapshot_mb
        if override is not None and override.max_snapshot_mb is not None:
            mb = override.max_snapshot_mb
        return None if mb is None else int(mb * 1024 * 1024)


class UIConfig(_Section):
    """The events page and its REST API."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    api_key: str | None = Field(
        None,
        description="Bearer key for /api/* (VS_UI__API_KEY); required off loopback",
    )
    sse_heartbeat_s: float = Field(15.0, gt=0, description="keep-alive comment on idle streams")
    redescribe_concurrency: int = Field(2, ge=1, le=64, description="re-describe calls at once")

    @field_validator("api_key")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            return None
        return value
