"""The ``vision-serve`` command: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and registers itself through an
``add_*_cli(subparsers)`` function; imports are deferred to keep ``--help`` fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> "module:function" that adds its parser (and sets ``func``)
SUBCOMMANDS: dict[str, str] = {
    "make-model": "engine.checkpoints:add_make_model_cli",
    "chat": "engine.chat_cli:add_chat_cli",
    "serve": "vision_serve.server_cli:add_serve_cli",
    "pipeline": "pipelines.cli:add_pipeline_cli",
    "describe": "pipelines.cli:add_describe_cli",
    "make-detector": "pipelines.cli:add_make_detector_cli",
    "export-detector": "pipelines.cli:add_export_detector_cli",
    "ui": "pipelines.events.cli:add_ui_cli",
    "notify": "pipelines.notify.cli:add_notify_cli",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vision-serve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, target in SUBCOMMANDS.items():
        if wanted is not None and name != wanted:
            subparsers.add_parser(name)
            continue
        module_name, func_name = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if wanted is None:  # listing help: show the command even if not importable yet
                subparsers.add_parser(name, help=f"(unavailable: {exc})")
                continue
            raise
        getattr(module, func_name)(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
