"""``vision-serve serve``: load the engine, then serve the OpenAI-compatible API with uvicorn.

Engine flags are vLLM's names and come from :func:`engine.config.add_engine_cli_args`; server
flags mirror :class:`vision_serve.settings.ServerSettings`. Both read ``VISION_SERVE_*``
environment variables as defaults (for compose); flags given on the command line win.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vision_serve.settings import ServerSettings

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger("vision_serve.server")

# server flag -> (argparse kwargs); default None means "take the environment / built-in default"
_SERVER_FLAGS: dict[str, dict[str, Any]] = {
    "host": {"help": "bind address"},
    "port": {"type": int, "help": "port"},
    "served_model_name": {
        "nargs": "+",
        "help": "model name(s) clients use; the first is reported (default: checkpoint dir name)",
    },
    "api_key": {"help": "require 'Authorization: Bearer KEY' on /v1/*"},
    "allowed_media_domains": {
        "nargs": "+",
        "help": "hosts (and their subdomains) http(s) image URLs may come from",
    },
    "allow_private_media_addresses": {
        "action": argparse.BooleanOptionalAction,
        "help": "let listed media hosts resolve to loopback/private addresses (default off)",
    },
    "allowed_local_media_path": {"help": "directory file:// image URLs may point into"},
    "media_fetch_timeout_s": {"type": float, "help": "timeout for fetching an image URL"},
    "max_image_bytes": {"type": int, "help": "largest image accepted, in bytes"},
    "max_images_per_request": {"type": int, "help": "images one request may carry (400 above)"},
    "max_image_pixels": {"type": int, "help": "pixels one image may have (400 above)"},
    "max_request_pixels": {"type": int, "help": "pixels all images of a request may have"},
    "max_video_frames": {"type": int, "help": "frames one video part may carry or be sampled to"},
    "video_fps": {"type": float, "help": "rate frames are sampled from a video_url file"},
    "max_concurrent_image_decodes": {"type": int, "help": "images decoded at once, server-wide"},
    "max_request_body_mb": {"type": float, "help": "largest request body (413 above)"},
    "allowed_origins": {
        "nargs": "+",
        "help": "CORS origins browsers may call from (vLLM's flag; a JSON list works too)",
    },
    "allowed_methods": {"nargs": "+", "help": "CORS methods allowed"},
    "allowed_headers": {"nargs": "+", "help": "CORS request headers allowed"},
    "allow_credentials": {
        "action": argparse.BooleanOptionalAction,
        "help": "CORS: let browsers send cookies/credentials (default off)",
    },
    "graceful_shutdown_s": {"type": float, "help": "seconds to drain streams on shutdown"},
    "log_level": {"help": "debug | info | warning | error"},
    "log_requests": {
        "action": argparse.BooleanOptionalAction,
        "help": "one JSON log line per request (default on)",
    },
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except the ``None`` placeholders that mean "not given"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _server_help(name: str, text: str) -> str:
    """Help text with the built-in default (not the environment's: it may hold a secret)."""
    default = ServerSettings.model_fields[name].get_default(call_default_factory=True)
    if default in (None, []) or "default" in text:
        return text
    return f"{text} (default: {default})"


def add_serve_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` with the top-level ``vision-serve`` parser."""
    from engine.config import add_engine_cli_args

    parser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server in front of the engine",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    group = parser.add_argument_group("server")
    for name, kwargs in _SERVER_FLAGS.items():
        kwargs = {**kwargs, "help": _server_help(name, kwargs["help"])}
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **kwargs)
    add_engine_cli_args(parser)
    parser.set_defaults(func=run_serve)


def settings_from_namespace(args: argparse.Namespace) -> ServerSettings:
    """Flags given on the command line override ``VISION_SERVE_*`` variables."""
    given = {name: getattr(args, name, None) for name in _SERVER_FLAGS}
    return ServerSettings(**{name: value for name, value in given.items() if value is not None})


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def run_serve(args: argparse.Namespace) -> int:
    """Load the model (blocking), serve until SIGINT/SIGTERM, then stop the engine.

    Exit status: 0 after a signal, 1 if the engine's step loop died (a supervisor restarts
    the process), 3 if uvicorn could not start."""
    import uvicorn

    from engine import AsyncEngine, openmp
    from engine.config import engine_args_from_namespace
    from engine.generation_config import GenerationConfigError
    from engine.model_source import ModelSourceError
    from engine.step_trace import StepTraceError
    from vision_serve.app import create_app

    settings = settings_from_namespace(args)
    configure_logging(settings.log_level)
    if not args.model:
        logger.error("--model (or VISION_SERVE_MODEL) is required")
        return 2
    try:
        engine_args = engine_args_from_namespace(args)
    except ValueError as exc:  # a flag's value: one clear line, not a traceback
        logger.error("%s", exc)
        return 2
    logger.info("loading model %s (pid %d) ...", engine_args.model, os.getpid())
    t0 = time.monotonic()
    try:
        # a Hub id is fetched here; what cannot be had is one clear line, not a traceback
        engine = AsyncEngine(engine_args)
    except (ModelSourceError, StepTraceError) as exc:
        logger.error("%s", exc)
        return 2
    # this process serves: the step loop's OpenMP team is the only one (engine/openmp.py)
    openmp.serial_thread()
    logger.info(
        "model %s loaded in %.1fs; max_model_len=%s",
        engine.model_name,
        time.monotonic() - t0,
        engine.max_model_len,
    )
    died = threading.Event()
    try:
        try:
            app = create_app(engine, settings)
        except GenerationConfigError as exc:
            logger.error("%s", exc)
            return 2
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            log_config=None,  # keep our logging setup; uvicorn's loggers propagate to root
            timeout_graceful_shutdown=settings.graceful_shutdown_s,
        )
        server = uvicorn.Server(config)
        engine.add_death_callback(_stop_on_engine_death(server, settings.graceful_shutdown_s, died))
        # uvicorn re-raises the SIGINT it handled; uvicorn.run swallows it the same way
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        if not server.started and not died.is_set():
            return 3  # uvicorn's STARTUP_FAILURE (e.g. the port is taken)
    finally:
        engine.shutdown()
    return 1 if died.is_set() else 0


def _stop_on_engine_death(
    server: uvicorn.Server, grace_s: float, died: threading.Event
) -> Callable[[BaseException], None]:
    """Death callback for the engine: stop uvicorn so the process exits 1.

    A process that stays up with a dead engine answers every request with 503 and a container
    restart policy never acts; exiting lets compose/k8s/systemd restart it. Open streams already
    got their error, so the graceful shutdown is short; a timer ends the process regardless if
    it hangs (a stuck connection)."""

    def on_death(exc: BaseException) -> None:
        logger.critical("engine step loop died (%r): shutting down with exit code 1", exc)
        died.set()
        server.should_exit = True
        watchdog = threading.Timer(grace_s + 10.0, os._exit, args=(1,))
        watchdog.daemon = True
        watchdog.start()

    return on_death
