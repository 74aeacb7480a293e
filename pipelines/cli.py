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


def add_make_detector_cli(subparsers: Any) -> None:
    """Register ``make-detector``: train a YOLO26n person detector offline on synthetic frames."""
    parser = subparsers.add_parser(
        "make-detector",
        help="train (once, cached) a YOLO26n person detector offline on synthetic frames",
        description=add_make_detector_cli.__doc__,
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset and training seed")
    parser.add_argument("--out", default=None, help="output directory (default: the cache)")
    parser.add_argument("--epochs", type=int, default=None, help="override the recipe's epochs")
    parser.add_argument("--force", action="store_true", help="train again even if cached")
    parser.set_defaults(func=run_make_detector)


def run_make_detector(args: argparse.Namespace) -> int:
    """Print the summary on stderr and the weights path as stdout's last line; exit 1 when
    training fails."""
    from dataclasses import replace
    from pathlib import Path

    from pipelines.detector_training import Recipe, make_detector

    recipe = Recipe() if args.epochs is None else replace(Recipe(), epochs=max(1, args.epochs))
    out = None if args.out is None else Path(args.out)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        build = make_detector(args.seed, out, recipe, force=args.force, log=say)
    except Exception as exc:  # a failed build leaves no cache entry behind
        say(f"error: make-detector failed: {exc}")
        return 1
    say(build.summary())
    print(build.weights, flush=True)
    return 0


def add_export_detector_cli(subparsers: Any) -> None:
    """Register ``export-detector``: a ``.pt`` detector as ONNX or OpenVINO."""
    parser = subparsers.add_parser(
        "export-detector",
        help="export a YOLO .pt detector to ONNX or OpenVINO (fixed input size)",
        description=add_export_detector_cli.__doc__,
    )
    parser.add_argument(
        "--weights", default=None, help="a .pt file (default: make-detector's cached build)"
    )
    parser.add_argument("--format", required=True, choices=["onnx", "openvino"])
    parser.add_argument(
        "--imgsz", type=int, default=None, help="input size (default: the build's, else 640)"
    )
    parser.add_argument("--out", default=None, help="where to put the export (default: beside)")
    parser.set_defaults(func=run_export_detector)


def run_export_detector(args: argparse.Namespace) -> int:
    """Print the export's path; exit 2 naming the flag when the input is wrong."""
    from pathlib import Path

    from pipelines.detector_export import ExportError, export_detector
    from pipelines.detector_training import detector_dir, load_build

    weights, imgsz = args.weights, args.imgsz
    if weights is None:
        build = load_build(detector_dir())
        if build is None:
            print(
                "error: --weights: none given and no cached build; run "
                "`vision-serve make-detector` first",
                file=sys.stderr,
            )
            return 2
        weights, imgsz = build.weights, imgsz or build.imgsz
    try:
        path = export_detector(
            weights, args.format, imgsz or 640, None if args.out is None else Path(args.out)
        )
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path, flush=True)
    return 0
