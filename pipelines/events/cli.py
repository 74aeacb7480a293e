"""``vision-serve ui``: the event store, its REST API and the events page, in one process.

Stops cleanly on SIGTERM/SIGINT (uvicorn's handlers): open live streams get
``SHUTDOWN_GRACE_S``, then the consumer finishes its batch (acknowledged only once stored)
and the store closes.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from typing import Any

SHUTDOWN_GRACE_S = 2


def add_ui_cli(subparsers: Any) -> None:
    """Register ``ui``: descriptions -> event store (SQLite + snapshots) -> page and API."""
    parser = subparsers.add_parser(
        "ui",
        help="store descriptions as events; serve the events page and its REST API",
        description=add_ui_cli.__doc__,
    )
    parser.add_argument("--config", required=True, metavar="PATH", help="cameras YAML file")
    parser.add_argument("--host", default=None, help="override ui.host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="override ui.port (default 8080)")
    parser.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(func=run_ui)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_ui(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; exit status 2 on a configuration error."""
    from pipelines.config import ConfigError, load_config
    from pipelines.logs import setup_logging

    try:
        config = load_config(args.config)
        if args.host is not None:
            config.ui.host = args.host
        if args.port is not None:
            config.ui.port = args.port
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if config.ui.api_key is None and not is_loopback(config.ui.host):
        print(
            f"error: {args.config}: ui.api_key (or VS_UI__API_KEY) is required to listen on "
            f"{config.ui.host}; without a key only a loopback address is allowed",
            file=sys.stderr,
        )
        return 2
    level = args.log_level or config.log_level
    setup_logging(level)
    import uvicorn

    from pipelines.events.app import create_app

    app = create_app(config)
    uvicorn.run(
        app,
        host=config.ui.host,
        port=config.ui.port,
        log_level=level.lower(),
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        log_config=None,  # our one-line format (setup_logging)
    )
    return 0
