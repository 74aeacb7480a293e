# One image for every vision-serve process: `serve`, `pipeline`, `describe`.
# CPU build; for a GPU host swap the torch index URL (or base on a CUDA runtime image).
# Runs as the unprivileged user `vision` (uid 10001) with a read-only root file system in
# compose.yaml: everything it writes goes to /tmp (tmpfs) or /cache (a volume, vlm only).
FROM python:3.11-slim-bookworm

# VISION_SERVE_CACHE_DIR: start-up calibrations of the step policy (engine/calibration.py);
# TORCH_EXTENSIONS_DIR: the compiled CPU kernels (engine/kernels), built below and kept in the
# same volume; /tmp: Ultralytics' settings, Matplotlib's cache, compiler scratch.
# No hub is ever asked for weights or code: models are mounted, and *_OFFLINE make a missing
# file an error instead of a download. ULTRALYTICS_SAFE_LOAD: YOLO .pt files are pickles, which
# can run code when loaded; this loads them with torch's weights_only and Ultralytics' list of
# known classes, so a planted .pt is refused instead of run (0 turns it off).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    YOLO_OFFLINE=1 \
    YOLO_AUTOINSTALL=False \
    ULTRALYTICS_SAFE_LOAD=1 \
    YOLO_CONFIG_DIR=/tmp/ultralytics \
    MPLCONFIGDIR=/tmp/matplotlib \
    VISION_SERVE_CACHE_DIR=/cache \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions

# ffmpeg: tools for camera debugging (OpenCV's wheel carries its own FFmpeg);
# libgl1/libglib2.0-0: opencv-python, which ultralytics pulls in next to the headless build;
# g++: engine/kernels (the CPU decode step and attention) compile on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg libgl1 libglib2.0-0 g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY vision_serve ./vision_serve
COPY pipelines ./pipelines
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu .

# /cache belongs to `vision`: a new named volume mounted there takes this owner and the
# kernels built below, so the first start on the build host's CPU compiles nothing; the same
# for /data/events (the ui's event store)
RUN groupadd --gid 10001 vision \
    && useradd --create-home --uid 10001 --gid 10001 vision \
    && mkdir -p /cache /data/events \
    && chown vision:vision /cache /data/events
USER 10001:10001
# The kernel build holds the variant for the build host's CPU (native or emulated bf16, see
# engine/kernels); a container on a CPU that needs the other variant builds it at first start
# (~30 s) into the volume; without AVX-512 this is a no-op
RUN python -m engine.kernels

ENTRYPOINT ["vision-serve"]
CMD ["--help"]
