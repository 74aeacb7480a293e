"""Camera side of vision-serve: ingest -> detect -> gate -> Redis Streams -> describers.

Ultralytics is told to stay offline before anything here can import it: no weight or
asset downloads and no pip auto-installs at run time (our machines may have no internet), and
weights load through its safe unpickler.
"""

import os

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_AUTOINSTALL", "False")
# Weights are unpickled with Ultralytics' allow-list only: a planted .pt cannot run code.
os.environ.setdefault("ULTRALYTICS_SAFE_LOAD", "1")
