#!/usr/bin/env bash
# Install the system packages the camera pipeline and its tests need (Debian/Ubuntu).
#
# Why each package:
#   redis-server                      Redis Streams queue (tests start their own instance)
#   ffmpeg                            builds test videos; OpenCV's FFMPEG backend decodes RTSP
#   gstreamer1.0-rtsp                 the GStreamer RTSP server library ...
#   gir1.2-gst-rtsp-server-1.0        ... and its introspection data, for scripts/rtsp_server.py
#   python3-gi                        GObject bindings (import only in Debian's /usr/bin/python3)
#   gstreamer1.0-plugins-base/-good   multifilesrc, jpegdec, videoconvert, videoscale, rtp payloaders
#   gstreamer1.0-plugins-bad/-ugly    h264parse, x264enc (H.264 over RTSP)
#   gstreamer1.0-libav                extra decoders (mp4/h264 sources)
#   gstreamer1.0-tools                gst-launch-1.0 / gst-inspect-1.0, for debugging
#   g++                               compiles engine/kernels (the fused CPU decode step)
#   mosquitto                         MQTT broker the notifier tests start (mosquitto_passwd too)
#   mosquitto-clients                 mosquitto_sub: the compose broker's healthcheck, run in a test
#   chromium                          headless browser for the events page test (tests/events)
#
# Idempotent: when every package is already installed it does nothing (no apt-get update).
set -euo pipefail

PACKAGES=(
  redis-server
  ffmpeg
  gstreamer1.0-rtsp
  gir1.2-gst-rtsp-server-1.0
  python3-gi
  gstreamer1.0-plugins-base
  gstreamer1.0-plugins-good
  gstreamer1.0-plugins-bad
  gstreamer1.0-plugins-ugly
  gstreamer1.0-libav
  gstreamer1.0-tools
  g++
  mosquitto
  mosquitto-clients
  chromium
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  # dpkg-query, not `dpkg -s | grep -q`: with pipefail an early grep exit fails the pipe.
  if [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$pkg")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-system-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi

echo "install-system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-system-deps: done"
