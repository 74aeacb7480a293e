"""``python -m engine.kernels``: ready this CPU's native kernels ahead of use.

Without options: imports this CPU's modules, prebuilt (``$VISION_SERVE_KERNELS_DIR``) or from
the build cache, compiling them there if needed. Exits 0 when the machine cannot build or run
them: it runs the eager path (the log says why).

``--prebuild DIR`` builds every variant's modules into DIR and imports none of them (the Docker
image's build: one image for every x86 CPU class); exits 1 if one fails. ``--verify DIR``
imports this CPU's modules from DIR without compiling anything, and exits 1 if one is missing,
stale or does not load: proof, on the build host, that the prebuilt modules are the ones the
runtime takes. ``--compile-check`` compiles the variants this machine does not build to object
code only (all with ``--all``), and exits 1 if one fails: CI on an AVX2-only machine still
proves that the AVX-512 builds compile.
"""

import argparse
import logging
import platform
import sys
import time
from pathlib import Path

from engine.kernels import (
    VARIANTS,
    build,
    compile_check,
    cpu_variant,
    extensions,
    load_cpu_decode,
    load_int8_linear,
    prebuild,
    variants_not_loaded,
)

logging.basicConfig(level=logging.INFO, format="%(message)s")
ap = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
mode = ap.add_mutually_exclusive_group()
mode.add_argument("--prebuild", type=Path, metavar="DIR", help="build every variant into DIR")
mode.add_argument("--verify", type=Path, metavar="DIR", help="import this CPU's modules from DIR")
mode.add_argument("--compile-check", action="store_true")
ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="with --prebuild: only these")
ap.add_argument("--all", action="store_true", help="with --compile-check: every variant")
args = ap.parse_args()


def _report(results: dict[str, str | None], what: str, seconds: float | None = None) -> None:
    """Each failure on stderr, one count line, and the exit status CI reads."""
    failed = {name: err for name, err in results.items() if err}
    for name, err in failed.items():
        print(f"{name}: FAILED\n{err}", file=sys.stderr)
    took = "" if seconds is None else f" in {seconds:.0f} s"
    print(f"{what}: {len(results) - len(failed)}/{len(results)}{took}")
    sys.exit(1 if failed else 0)


if args.compile_check:
    variants = list(VARIANTS) if args.all else variants_not_loaded()
    _report(compile_check(variants=variants), f"kernel sources compiled ({', '.join(variants)})")

if args.prebuild is not None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"kernels are x86-64 only: nothing prebuilt on {platform.machine()} (eager path)")
        sys.exit(0)
    t0 = time.perf_counter()
    results = prebuild(args.prebuild, args.variants)
    _report(results, f"kernel modules prebuilt into {args.prebuild}", time.perf_counter() - t0)

if args.verify is not None:
    variant = cpu_variant()
    if variant is None:
        print("this CPU runs no kernel variant (neither AVX-512 nor AVX2): nothing to verify")
        sys.exit(0)
    bad = 0
    for ext in extensions(variant):
        try:
            module = build.load(ext, args.verify, cache=None)
        except Exception as exc:
            print(f"FAILED {exc}", file=sys.stderr)
            bad += 1
        else:
            print(f"{ext.name}: loads from {module.__file__} (variant {variant})")
    sys.exit(1 if bad else 0)

load_cpu_decode()
load_int8_linear()
