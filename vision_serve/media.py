"""Image URL policy and image loading.

The server, not the engine, decides where images may come from: ``data:`` URLs always;
``http(s)`` only from hosts listed in ``--allowed-media-domains`` (otherwise any client could
make the server fetch internal addresses); ``file://`` only under
``--allowed-local-media-path``. Everything else, including bare paths the engine itself would
open, is refused. Images are decoded here (in a worker thread) so that a broken image becomes
a 400 naming the exact message part, and the engine receives ready ``PIL`` images.

Video parts arrive as a list of frame URLs (each loaded like an image) or as one video file
(``video_url``), whose frames OpenCV samples at ``--video-fps``, at most ``--max-video-frames``.
Every frame counts as an image against the doors below.

A request's images pass three doors, cheapest first, so that refusing costs less than the
attack: their count (before anything is fetched), their declared pixels per image and per
request (read from the file headers, before any pixel is decoded: a decompression bomb is a
small file that declares a huge image), and a server-wide bound on concurrent decodes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import stat
import struct
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image, ImageFile, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

from vision_serve.errors import bad_request
from vision_serve.settings import ServerSettings

ALLOWED_MIME = {"image/jpeg", "image/jpg", "image/png", "image/webp"}
VIDEO_MIME = {"video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo"}


@dataclass
class ClipSource:
    """One video part as sent: frame URLs, or one video file URL (then ``frames`` is None)."""

    param: str
    frames: list[str] | None = None
    url: str | None = None
    fps: float | None = None


@dataclass
class Clip:
    """A decoded clip for the engine: its frames and the rate they were sampled at."""

    frames: list[Image.Image]
    fps: float | None


@dataclass
class _ProbedVideo:
    data: bytes
    width: int
    height: int
    indices: list[int]  # frames to keep
    fps: float  # rate of the kept frames


class MediaLoader:
    """Turns an ``image_url`` string into a decoded RGB image, or a 400 naming ``param``."""

    def __init__(self, settings: ServerSettings, client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self._client = client
        local = settings.allowed_local_media_path
        self._local_root = Path(local).resolve() if local else None
        self._decode_slots = asyncio.Semaphore(settings.max_concurrent_image_decodes)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def load(self, url: str, param: str) -> Image.Image:
        """Fetch (when allowed) and decode one image URL."""
        (image,) = await self.load_all([(url, param)])
        return image

    async def load_all(
        self, items: list[tuple[str, str]], param: str = "messages"
    ) -> list[Image.Image]:
        """Fetch and decode a request's images, ``(url, param)`` each, or raise the first 400.

        All sources are read and all headers checked before the first decode, so a request
        that would be refused for its total pixels never costs a decode."""
        images, _ = await self.load_media(items, [], param)
        return images

    async def load_media(
        self, items: list[tuple[str, str]], clips: list[ClipSource], param: str = "messages"
    ) -> tuple[list[Image.Image], list[Clip]]:
        """A request's images and video clips, every frame through the same doors as an image."""
        max_frames = self.settings.max_video_frames
        for clip in clips:
            if clip.frames is not None and not clip.frames:
                raise bad_request("a video needs at least one frame", param=f"{clip.param}.video")
            if clip.frames is not None and len(clip.frames) > max_frames:
                raise bad_request(
                    f"a video may carry at most {max_frames} frames; this one has "
                    f"{len(clip.frames)} (see --max-video-frames)",
                    param=f"{clip.param}.video",
                    code="too_many_frames",
                )
        frame_items = [
            (url, f"{clip.param}.video[{k}]")
            for clip in clips
            if clip.frames is not None
            for k, url in enumerate(clip.frames)
        ]
        files = [clip for clip in clips if clip.frames is None]
        self._check_count(len(items) + len(frame_items) + len(files), param)
        probed = await asyncio.gather(*(self._probe_video_file(clip) for clip in files))
        self._check_count(
            len(items) + len(frame_items) + sum(len(v.indices) for v in probed), param
        )
        all_items = items + frame_items
        payloads = await asyncio.gather(*(self._read(url, p) for url, p in all_items))
        headers = [probe_image(data, p) for data, (_, p) in zip(payloads, all_items, strict=True)]
        headers += [
            (video.width, video.height)
            for clip, video in zip(files, probed, strict=True)
            for _ in video.indices
        ]
        params = [p for _, p in all_items]
        params += [
            f"{clip.param}.video_url"
            for clip, video in zip(files, probed, strict=True)
            for _ in video.indices
        ]
        self._check_pixels(headers, params, param)
        decoded = await asyncio.gather(
            *(self._decode(data, p) for data, (_, p) in zip(payloads, all_items, strict=True)),
            *(
                self._decode_video(video, f"{clip.param}.video_url")
                for clip, video in zip(files, probed, strict=True)
            ),
        )
        images, rest = list(decoded[: len(items)]), decoded[len(items) :]
        frames, file_frames = list(rest[: len(frame_items)]), iter(rest[len(frame_items) :])
        file_rates = iter(video.fps for video in probed)
        out: list[Clip] = []
        for clip in clips:
            if clip.frames is None:
                out.append(Clip(next(file_frames), next(file_rates)))
            else:
                n = len(clip.frames)
                out.append(Clip(frames[:n], clip.fps))
                frames = frames[n:]
        return images, out

    def _check_count(self, count: int, param: str) -> None:
        limit = self.settings.max_images_per_request
        if count > limit:
            raise bad_request(
                f"a request may carry at most {limit} images (video frames count as images); "
                f"this one has {count} (see --max-images-per-request)",
                param=param,
                code="too_many_images",
            )

    def _check_pixels(self, headers: list[tuple[int, int]], params: list[str], param: str) -> None:
        total = 0
        for (width, height), p in zip(headers, params, strict=True):
            pixels = width * height
            if pixels > self.settings.max_image_pixels:
                raise bad_request(
                    f"image is {width}x{height} = {pixels} pixels; the limit is "
                    f"{self.settings.max_image_pixels} (see --max-image-pixels)",
                    param=p,
                    code="image_too_large",
                )
            total += pixels
        if total > self.settings.max_request_pixels:
            raise bad_request(
                f"the request's images have {total} pixels in all; the limit is "
                f"{self.settings.max_request_pixels} (see --max-request-pixels)",
                param=param,
                code="image_too_large",
            )

    async def _probe_video_file(self, clip: ClipSource) -> _ProbedVideo:
        param = f"{clip.param}.video_url"
        data = await self._read(clip.url or "", param, VIDEO_MIME)
        async with self._decode_slots:
            return await asyncio.to_thread(
                probe_video,
                data,
                param,
                self.settings.video_fps,
                self.settings.max_video_frames,
            )

    async def _decode_video(self, video: _ProbedVideo, param: str) -> list[Image.Image]:
        async with self._decode_slots:
            return await asyncio.to_thread(decode_video, video, param)

    async def _decode(self, data: bytes, param: str) -> Image.Image:
        async with self._decode_slots:
            return await asyncio.to_thread(decode_image, data, param)

    async def _read(self, url: str, param: str, mime: set[str] = ALLOWED_MIME) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._decode_data_url(url, param, mime)
        if scheme in ("http", "https"):
            return await self._fetch(url, param)
        if scheme == "file":
            # a thread: a slow disk or network mount must not stall the event loop
            return await asyncio.to_thread(self._read_local, url, param)
        raise bad_request(
            "image_url must be a data: URL, an allowed http(s) URL or an allowed file:// URL",
            param=param,
            code="invalid_image_url",
        )

    # -- sources -------------------------------------------------------------------------------

    def _decode_data_url(self, url: str, param: str, allowed: set[str] = ALLOWED_MIME) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep:
            raise bad_request("malformed data URL (no ',')", param=param, code="invalid_image_url")
        meta = header[len("data:") :].split(";")
        mime = meta[0].strip().lower()
        if mime not in allowed:
            video = allowed is VIDEO_MIME
            raise bad_request(
                f"unsupported {'video' if video else 'image'} type {mime or '(none)'!r}; use "
                + (", ".join(sorted(VIDEO_MIME)) if video else "JPEG, PNG or WebP"),
                param=param,
                code="invalid_video" if video else "invalid_image",
            )
        if "base64" not in [m.strip().lower() for m in meta[1:]]:
            raise bad_request("data URL must be base64-encoded", param=param, code="invalid_image")
        if len(payload) * 3 // 4 > self.settings.max_image_bytes:
            raise bad_request("image too large", param=param, code="image_too_large")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(
                "data URL is not valid base64", param=param, code="invalid_image"
            ) from None

    def _host_allowed(self, host: str) -> bool:
        host = host.lower().strip(".")
        return any(
            host == domain or host.endswith("." + domain)
            for domain in self.settings.allowed_media_domains
        )

    async def _fetch(self, url: str, param: str) -> bytes:
        try:
            parts = urllib.parse.urlsplit(url)
            host = parts.hostname or ""
            parts.port  # noqa: B018  (raises on a port that is not a number in range)
        except ValueError:
            raise bad_request(
                "malformed image URL", param=param, code="invalid_image_url"
            ) from None
        if not self._host_allowed(host):
            raise bad_request(
                f"fetching images from {host or 'this URL'!r} is not allowed "
                "(see --allowed-media-domains)",
                param=param,
                code="media_domain_not_allowed",
            )
        await self._refuse_internal_addresses(host, param)
        if self._client is None:
            # Redirects are not followed: a redirect could leave the allowed domains. No proxy
            # variables or .netrc: the server's environment must not change where it fetches.
            self._client = httpx.AsyncClient(
                timeout=self.settings.media_fetch_timeout_s,
                follow_redirects=False,
                trust_env=False,
            )
        limit = self.settings.max_image_bytes
        try:
            async with asyncio.timeout(self.settings.media_fetch_timeout_s):
                return await self._download(url, param, limit)
        except TimeoutError:
            raise bad_request(
                f"fetching image took longer than {self.settings.media_fetch_timeout_s:g}s",
                param=param,
                code="image_fetch_failed",
            ) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise bad_request(
                f"fetching image failed: {type(exc).__name__}",
                param=param,
                code="image_fetch_failed",
            ) from None

    async def _refuse_internal_addresses(self, host: str, param: str) -> None:
        """An allowed name must not resolve to loopback, private, link-local (cloud metadata)
        or other special addresses unless ``--allow-private-media-addresses``: the allow-list
        names hosts, and a name can point anywhere. (A name re-resolved differently between
        this check and the connection is not covered.)"""
        if self.settings.allow_private_media_addresses:
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None)
        except OSError:
            raise bad_request(
                f"image host {host!r} does not resolve", param=param, code="image_fetch_failed"
            ) from None
        for *_, sockaddr in infos:
            address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if not address.is_global:
                raise bad_request(
                    f"image host {host!r} resolves to a non-public address "
                    "(see --allow-private-media-addresses)",
                    param=param,
                    code="media_domain_not_allowed",
                )

    async def _download(self, url: str, param: str, limit: int) -> bytes:
        assert self._client is not None
        async with self._client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise bad_request(
                    f"fetching image failed with HTTP {resp.status_code}",
                    param=param,
                    code="image_fetch_failed",
                )
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise bad_request("image too large", param=param, code="image_too_large")
                chunks.append(chunk)
            return b"".join(chunks)

    def _read_local(self, url: str, param: str) -> bytes:
        if self._local_root is None:
            raise bad_request(
                "file:// image URLs are not allowed (see --allowed-local-media-path)",
                param=param,
                code="local_media_not_allowed",
            )
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise bad_request("file:// URL must not name a host", param=param)
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        if not path.is_relative_to(self._local_root):
            raise bad_request(
                "file:// path is outside --allowed-local-media-path",
                param=param,
                code="local_media_not_allowed",
            )
        try:
            info = path.stat()
            if not stat.S_ISREG(info.st_mode):  # a FIFO or device would block the read forever
                raise bad_request(
                    "file:// path is not a regular file", param=param, code="invalid_image"
                )
            if info.st_size > self.settings.max_image_bytes:
                raise bad_request("image too large", param=param, code="image_too_large")
            with path.open("rb") as f:  # bounded read: the file may grow after the stat
                data = f.read(self.settings.max_image_bytes + 1)
            if len(data) > self.settings.max_image_bytes:
                raise bad_request("image too large", param=param, code="image_too_large")
            return data
        except OSError:
            raise bad_request(
                "file:// image could not be read", param=param, code="invalid_image"
            ) from None


def _image_class(data: bytes) -> type[ImageFile.ImageFile] | None:
    """Pick the decoder from the file's magic bytes; None for anything but JPEG/PNG/WebP."""
    if data.startswith(b"\xff\xd8\xff"):
        return JpegImagePlugin.JpegImageFile
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return PngImagePlugin.PngImageFile
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return WebPImagePlugin.WebPImageFile
    return None


def probe_image(data: bytes, param: str) -> tuple[int, int]:
    """The declared ``(width, height)`` from the header alone: no pixel is decoded here."""
    image_class = _image_class(data)
    if image_class is None:
        raise bad_request("image is not JPEG, PNG or WebP data", param=param, code="invalid_image")
    try:
        width, height = image_class(io.BytesIO(data)).size
    except _DECODE_ERRORS as exc:
        raise _undecodable(exc, param) from None
    if width < 1 or height < 1:
        raise bad_request("image has no pixels", param=param, code="invalid_image")
    return width, height


def decode_image(data: bytes, param: str) -> Image.Image:
    """Decode JPEG/PNG/WebP bytes fully (a truncated file fails here, not in the engine).

    The format's decoder is called directly instead of ``Image.open``: other libraries patch
    ``Image.open`` (importing ultralytics makes it try to pip-install a HEIF plugin when an
    image is unrecognised), and a server must not do that on a client's garbage bytes.
    Callers check the declared size with :func:`probe_image` first; Pillow's own bomb limit
    stays as the last guard.
    """
    image_class = _image_class(data)
    if image_class is None:
        raise bad_request("image is not JPEG, PNG or WebP data", param=param, code="invalid_image")
    try:
        image = image_class(io.BytesIO(data))
        width, height = image.size
        if width < 1 or height < 1:
            raise ValueError("image has no pixels")
        if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
            raise bad_request("image has too many pixels", param=param, code="image_too_large")
        image.load()
        return image.convert("RGB")
    except _DECODE_ERRORS as exc:
        raise _undecodable(exc, param) from None


_DECODE_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    struct.error,
    EOFError,
    Image.DecompressionBombError,
    MemoryError,
)


def _undecodable(exc: BaseException, param: str) -> Exception:
    return bad_request(
        f"image could not be decoded ({type(exc).__name__})", param=param, code="invalid_image"
    )


def sample_indices(total: int, source_fps: float, fps: float, max_frames: int) -> list[int]:
    """Frames to keep from a ``total``-frame video: one every ``source_fps / fps`` frames,
    thinned evenly to ``max_frames`` when the clip is longer (the whole clip stays covered)."""
    step = max(1.0, source_fps / fps)
    picks = []
    k = 0.0
    while round(k) < total:
        picks.append(round(k))
        k += step
    if len(picks) > max_frames:
        picks = [picks[i * len(picks) // max_frames] for i in range(max_frames)]
    return picks


def _open_capture(data: bytes):
    """OpenCV reads video from a path only: the bytes go to a temporary file first."""
    import cv2

    tmp = tempfile.NamedTemporaryFile(suffix=".video")  # noqa: SIM115 - closed by the caller
    tmp.write(data)
    tmp.flush()
    cap = cv2.VideoCapture(tmp.name)
    return tmp, cap


def probe_video(data: bytes, param: str, fps: float, max_frames: int) -> _ProbedVideo:
    """The container's declared size and frame count, and the frames to keep: no frame is
    decoded here, so the pixel doors apply before decoding as for images."""
    import cv2

    tmp, cap = _open_capture(data)
    try:
        if not cap.isOpened():
            raise bad_request("video could not be opened", param=param, code="invalid_video")
        width = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        source_fps = float(cap.get(cv2.CAP_PROP_FPS)) or 0.0
    finally:
        cap.release()
        tmp.close()
    if width < 1 or height < 1 or total < 1 or source_fps <= 0:
        raise bad_request("video has no frames or no frame rate", param=param, code="invalid_video")
    indices = sample_indices(total, source_fps, fps, max_frames)
    # the rate of the kept frames, as transformers' VideoMetadata.sampled_fps computes it
    return _ProbedVideo(data, width, height, indices, len(indices) / total * source_fps)


def decode_video(video: _ProbedVideo, param: str) -> list[Image.Image]:
    """Decode the kept frames (sequential reads: seeking is unreliable across codecs)."""
    import cv2

    tmp, cap = _open_capture(video.data)
    frames: list[Image.Image] = []
    try:
        wanted, index = set(video.indices), 0
        last = max(video.indices)
        while index <= last:
            ok, frame = cap.read()
            if not ok:
                break
            if index in wanted:
                if frame.shape[:2] != (video.height, video.width):
                    raise bad_request(
                        "video frame size differs from its header", param, code="invalid_video"
                    )
                frames.append(Image.fromarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)))
            index += 1
    finally:
        cap.release()
        tmp.close()
    if not frames:
        raise bad_request("video frames could not be decoded", param=param, code="invalid_video")
    return frames
