"""``python -m engine.kernels``: build (or find cached) the native CPU kernels ahead of use.

Exits 0 when the machine cannot build or run them: it runs the eager path (the log says why).
``--compile-check`` instead compiles the variants this machine does not build (all with
``--all``), and exits 1 if one fails: CI on an AVX2-only machine still proves that the AVX-512
builds compile.
"""

import argparse
import logging
import sys

from engine.kernels import VARIANTS, compile_check, load_cpu_decode, variants_not_loaded

logging.basicConfig(level=logging.INFO, format="%(message)s")
ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--compile-check", action="store_true")
ap.add_argument("--all", action="store_true", help="with --compile-check: every variant")
args = ap.parse_args()
if args.compile_check:
    variants = list(VARIANTS) if args.all else variants_not_loaded()
    results = compile_check(variants=variants)
    failed = {name: err for name, err in results.items() if err}
    for name, err in failed.items():
        print(f"{name}: FAILED\n{err}", file=sys.stderr)
    print(
        f"kernel sources compiled ({', '.join(variants)}): {len(results) - len(failed)}/"
        f"{len(results)}"
    )
    sys.exit(1 if failed else 0)
load_cpu_decode()
