# One image for every vision-serve process: `serve`, `pipeline`, `describe`.
# CPU build; for a GPU host swap the torch index URL (or base on a CUDA runtime image).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    YOLO_OFFLINE=1 \
    YOLO_AUTOINSTALL=False \
    YOLO_CONFIG_DIR=/tmp/ultralytics

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

RUN useradd --create-home --uid 10001 vision
USER vision
# the kernel build cache lives in the image's home dir. It holds the variant for the build
# host's CPU (native or emulated bf16, see engine/kernels); a container on a CPU that needs the
# other variant builds it at first start (~30 s); without AVX-512 this is a no-op
RUN python -m engine.kernels

ENTRYPOINT ["vision-serve"]
CMD ["--help"]
