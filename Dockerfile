# One image for every vision-serve process: `serve`, `pipeline`, `describe`.
# CPU build; for a GPU host swap the torch index URL (or base on a CUDA runtime image).
# Runs as the unprivileged user `vision` (uid 10001) with a read-only root file system in
# compose.yaml: everything it writes goes to /tmp (tmpfs) or /cache (a volume, vlm only).
FROM python:3.11-slim-bookworm

# VISION_SERVE_CACHE_DIR: start-up calibrations of the step policy (engine/calibration.py);
# VISION_SERVE_KERNELS_DIR: the CPU kernels (engine/kernels) for every x86 CPU class, built
# below into the image (read-only at run time); TORCH_EXTENSIONS_DIR: where one is compiled at
# start only if the prebuilt one cannot be used (the log says why), kept in the /cache volume;
# /tmp: Ultralytics' settings, Matplotlib's cache, compiler scratch.
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
    VISION_SERVE_KERNELS_DIR=/opt/vision-serve/kernels \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions

# ffmpeg: tools for camera debugging (OpenCV's wheel carries its own FFmpeg);
# libgl1/libglib2.0-0: opencv-python, which ultralytics pulls in next to the headless build;
# g++: engine/kernels (the CPU decode step, attention, int8 GEMV) are compiled below, and again
# at start only where the prebuilt module cannot be used.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ffmpeg libgl1 libglib2.0-0 g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY vision_serve ./vision_serve
COPY pipelines ./pipelines
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu .

# Every kernel variant (AVX-512 with BF16, with VNNI, alone; AVX2) and the int8 GEMV, whatever
# CPU builds the image: the compiler targets the instruction set its flags name, and nothing is
# imported.
# Each module carries a stamp of its sources, flags, torch and Python; at start the engine
# imports the one for its CPU from here, so no container compiles (a stamp that does not match,
# or a damaged file, is compiled into /cache instead). --verify imports this CPU's modules
# from the directory with no compiler fallback: the image fails to build if they do not load.
# Run from / so that both see the installed package, as `vision-serve` does.
RUN cd / \
    && python -m engine.kernels --prebuild "$VISION_SERVE_KERNELS_DIR" \
    && python -m engine.kernels --verify "$VISION_SERVE_KERNELS_DIR"

# /cache belongs to `vision`: a new named volume mounted there takes this owner; the same for
# /data/events (the ui's event store)
RUN groupadd --gid 10001 vision \
    && useradd --create-home --uid 10001 --gid 10001 vision \
    && mkdir -p /cache /data/events \
    && chown vision:vision /cache /data/events
USER 10001:10001

ENTRYPOINT ["vision-serve"]
CMD ["--help"]
