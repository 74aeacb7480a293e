"""Camera side of vision-serve: ingest -> detect -> gate -> Redis Streams -> describers.

Ultralytics is told to stay offline before anything here can import it: no weight or
asset downloads and no pip auto-installs at run time (our machines may have no internet).
"""

import os

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_AUTOINSTALL", "False")
