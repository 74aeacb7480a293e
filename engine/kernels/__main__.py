"""``python -m engine.kernels``: build (or find cached) the native CPU kernels ahead of use.

Always exits 0: a machine that cannot build them runs the eager path (the log says why).
"""

import logging

from engine.kernels import load_cpu_decode

logging.basicConfig(level=logging.INFO, format="%(message)s")
load_cpu_decode()
