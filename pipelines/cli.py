"""``vision-serve pipeline`` and ``vision-serve describe``: the two camera-side processes.

Both read the same YAML file, expose Prometheus metrics, and stop cleanly on SIGTERM or
SIGINT: the pipeline flushes frames already gated to Redis, the describers finish (and
acknowledge) the frames in flight within ``describer.shutdown_grace_s`` and leave the rest
pending for another worker. Heavy imports (torch, ultralytics, openai) happen only when a
command runs, so ``vision-serve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from pipelines.config import ConfigError, PipelineConfig, load_config

log = logging.getLogger("pipelines.cli")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="PATH", help="cameras YAML file")
    parser.add_argument("--metrics-port", type=int, default=None, help="override metrics port")
    parser.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def add_pipeline_cli(subparsers: Any) -> None:
    """Register ``pipeline``: cameras -> YOLO26 -> gate -> Redis stream."""
    parser = subparsers.add_parser(
        "pipeline",
        help="read cameras, detect people with YOLO26, enqueue frames into Redis",
        description=add_pipeline_cli.__doc__,
    )
    _common(parser)
    parser.set_defaults(func=run_pipeline)


def add_describe_cli(subparsers: Any) -> None:
    """Register ``describe``: Redis consumer group -> OpenAI-compatible VLM -> descriptions."""
    parser = subparsers.add_parser(
        "describe",
        help="describe queued frames through an OpenAI-compatible endpoint",
        description=add_describe_cli.__doc__,
    )
    _common(parser)
    parser.add_argument("--consumer", default=None, help="consumer name (default host-pid)")
    parser.set_defaults(func=run_describe)


def _load(args: argparse.Namespace) -> PipelineConfig | None:
    from pipelines.logs import setup_logging

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    setup_logging(args.log_level or config.log_level)
    return config


def run_pipeline(args: argparse.Namespace) -> int:
    """Run ingest + detect + enqueue until SIGTERM/SIGINT; exit status 0 on a clean stop."""
    config = _load(args)
    if config is None:
        return 2
    if not config.cameras:
        print(f"error: {args.config}: cameras: at least one camera is needed", file=sys.stderr)
        return 2
    from pipelines.detect import Detector, DetectorError
    from pipelines.metrics import serve_metrics
    from pipelines.pipeline import CameraPipeline

    try:
        detector = Detector(config.detector)
    except DetectorError as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    pipeline = CameraPipeline(config, detector)
    port = config.metrics.pipeline_port if args.metrics_port is None else args.metrics_port
    serve_metrics(config.metrics.host, port)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: pipeline.stop())
    pipeline.run()
    return 0


def run_describe(args: argparse.Namespace) -> int:
    """Run describer workers until SIGTERM/SIGINT; exit status 0 on a clean stop."""
    config = _load(args)
    if config is None:
        return 2
    if not config.describer.model:
        print(
            f"error: {args.config}: describer.model: the served model's name is required",
            file=sys.stderr,
        )
        return 2
    from pipelines.describe import Describer
    from pipelines.metrics import serve_metrics

    port = config.metrics.describe_port if args.metrics_port is None else args.metrics_port
    serve_metrics(config.metrics.host, port)

    async def main() -> None:
        describer = Describer(config, consumer=args.consumer)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, describer.request_stop)
        await describer.run()

    asyncio.run(main())
    return 0
