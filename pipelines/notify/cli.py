"""``vision-serve notify --config cameras.yaml``: descriptions -> MQTT / webhooks.

Stops cleanly on SIGTERM or SIGINT: events being delivered get ``notify.shutdown_grace_s``,
the rest stay pending and are sent by the next start (same event ids). Exits with status 2
on a configuration error, 1 if the loop dies, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.cli import _common, _config_error, _load, _run_worker, _serve_metrics


def add_notify_cli(subparsers: Any) -> None:
    """Register ``notify``: descriptions stream -> MQTT (Home Assistant) and webhooks."""
    parser = subparsers.add_parser(
        "notify",
        help="send each description to MQTT (with Home Assistant discovery) and webhooks",
        description=add_notify_cli.__doc__,
    )
    _common(parser)
    parser.add_argument("--consumer", default=None, help="consumer name (default hostname)")
    parser.set_defaults(func=run_notify)


def run_notify(args: argparse.Namespace) -> int:
    """Run the notifier until SIGTERM/SIGINT; exit status 0 on a clean stop."""
    config = _load(args)
    if config is None:
        return 2
    if not config.notify.sinks_configured:
        return _config_error(args, "notify: configure notify.mqtt and/or notify.webhooks")
    import logging

    from pipelines.notify.notifier import Notifier

    # httpx logs each request's URL at INFO; a webhook URL may carry a token
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)

    _serve_metrics(args, config, config.notify.metrics_port)
    return _run_worker(lambda: Notifier(config, consumer=args.consumer))
