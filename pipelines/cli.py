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
from collections.abc import Callable
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


def _config_error(args: argparse.Namespace, message: str) -> int:
    """Say what in the file is wrong; exit status 2."""
    print(f"error: {args.config}: {message}", file=sys.stderr)
    return 2


def _serve_metrics(args: argparse.Namespace, config: PipelineConfig, port: int) -> None:
    """Prometheus metrics on ``port`` from the file, unless ``--metrics-port`` says otherwise."""
    from pipelines.metrics import serve_metrics

    serve_metrics(config.metrics.host, port if args.metrics_port is None else args.metrics_port)


def _run_worker(make: Callable[[], Any]) -> int:
    """Run an asyncio worker (``Describer``, ``Notifier``) made in its event loop until
    SIGTERM/SIGINT ask it to stop; exit status 0 on a clean stop."""

    async def main() -> None:
        worker = make()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, worker.request_stop)
        await worker.run()

    asyncio.run(main())
    return 0


def run_pipeline(args: argparse.Namespace) -> int:
    """Run ingest + detect + enqueue until SIGTERM/SIGINT; exit status 0 on a clean stop."""
    config = _load(args)
    if config is None:
        return 2
    if not config.cameras:
        return _config_error(args, "cameras: at least one camera is needed")
    from pipelines.detect import Detector, DetectorError
    from pipelines.pipeline import CameraPipeline

    try:
        detector = Detector(config.detector)
    except DetectorError as exc:
        return _config_error(args, str(exc))
    pipeline = CameraPipeline(config, detector)
    _serve_metrics(args, config, config.metrics.pipeline_port)
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
        return _config_error(args, "describer.model: the served model's name is required")
    from pipelines.describe import Describer

    _serve_metrics(args, config, config.metrics.describe_port)
    return _run_worker(lambda: Describer(config, consumer=args.consumer))
