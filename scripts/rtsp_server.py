#!/usr/bin/python3
"""A loopback RTSP server that loops a folder of JPEG images as H.264 video.

Why it exists: tests and benchmarks need real RTSP cameras, and ``ffmpeg`` alone cannot
serve RTSP. GStreamer's RTSP server can, but its Python bindings (``python3-gi`` with
``gir1.2-gst-rtsp-server-1.0``) import only in Debian's own ``/usr/bin/python3``, never in
the project's virtualenv -- so this script runs as a separate process with that interpreter
and uses nothing but the standard library and ``gi``.

Images must be named with a printf counter (``frame_00000.jpg`` ...) and share one size.
Each ``--mount`` is an independent camera (its own encoder); all clients of one mount share
one pipeline. Prints ``READY <url> ...`` on stdout once listening; stops on SIGTERM/SIGINT.

    /usr/bin/python3 scripts/rtsp_server.py --port 8554 --images DIR --fps 5 --mount /cam
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtsp", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtsp, GstRtspServer  # noqa: E402


def launch_line(pattern: str, fps: int, bitrate_kbps: int) -> str:
    """The media pipeline: images on a loop -> I420 -> x264 (low latency) -> RTP payload.

    ``key-int-max`` = one keyframe per second so a (re)connecting reader decodes quickly.
    """
    return (
        f'( multifilesrc location="{pattern}" index=0 loop=true '
        f'caps="image/jpeg,framerate={fps}/1" '
        "! jpegdec ! videoconvert ! video/x-raw,format=I420 "
        f"! x264enc tune=zerolatency speed-preset=ultrafast bitrate={bitrate_kbps} "
        f"key-int-max={fps} "
        "! rtph264pay name=pay0 pt=96 config-interval=1 )"
    )


def find_pattern(images: str) -> str:
    """The printf pattern multifilesrc needs, derived from the first image's name."""
    names = sorted(n for n in os.listdir(images) if n.lower().endswith((".jpg", ".jpeg")))
    if not names:
        raise SystemExit(f"rtsp_server: no .jpg images in {images}")
    stem, ext = os.path.splitext(names[0])
    digits = len(stem) - len(stem.rstrip("0123456789"))
    if digits == 0:
        raise SystemExit(f"rtsp_server: image names need a counter, got {names[0]!r}")
    return os.path.join(images, f"{stem[:-digits]}%0{digits}d{ext}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--images", required=True, help="folder of numbered same-size JPEGs")
    parser.add_argument("--fps", type=int, default=5)
    parser.add_argument("--bitrate-kbps", type=int, default=1000)
    parser.add_argument(
        "--mount", action="append", default=None, help="mount path, repeatable (default /cam)"
    )
    args = parser.parse_args()

    Gst.init(None)
    pattern = find_pattern(args.images)
    server = GstRtspServer.RTSPServer()
    server.set_address(args.host)
    server.set_service(str(args.port))
    mounts = server.get_mount_points()
    urls = []
    for mount in args.mount or ["/cam"]:
        factory = GstRtspServer.RTSPMediaFactory()
        factory.set_launch(launch_line(pattern, args.fps, args.bitrate_kbps))
        factory.set_shared(True)
        # TCP only: readers ask for RTSP-over-TCP, and UDP ports would leak off loopback.
        factory.set_protocols(GstRtsp.RTSPLowerTrans.TCP)
        mounts.add_factory(mount, factory)
        urls.append(f"rtsp://{args.host}:{args.port}{mount}")
    if server.attach(None) == 0:
        print(f"rtsp_server: cannot listen on {args.host}:{args.port}", file=sys.stderr)
        return 1

    loop = GLib.MainLoop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signum, loop.quit)
    print("READY " + " ".join(urls), flush=True)
    loop.run()
    print("rtsp_server: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
