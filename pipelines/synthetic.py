"""Synthetic camera frames with known person boxes, built from Ultralytics' two sample images.

Why: no trained detector weights are reachable offline, and an untrained YOLO26 finds nobody,
so the gate, tracking and zones could not run on real detections. The people in ``bus.jpg``
and ``zidane.jpg`` (shipped inside the ``ultralytics`` package) are cut out (GrabCut inside
their known boxes) and pasted onto varied backgrounds -- noise, gradients, drawn scenes, crops
of the samples' person-free regions -- at varied scales and positions, or moved across one
background for a clip. Masked patches of person-free regions are pasted too, as decoys, so a
detector learns people rather than "something pasted". Everything is drawn from a seeded
generator: the same seed gives the same frames, byte for byte.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

Box = tuple[float, float, float, float]  # x1, y1, x2, y2 in pixels

SAMPLE_SIZE = (640, 480)  # the samples are resized to this before boxes apply
# persons in the samples at 640x480 (bus.jpg's fourth, cut by the left edge, is labelled but
# never cut out: half a person pasted elsewhere would teach half-person boxes)
SAMPLE_PERSONS: dict[str, list[Box]] = {
    "bus.jpg": [
        (40.0, 178.0, 194.0, 402.0),
        (174.0, 180.0, 273.0, 382.0),
        (529.0, 169.0, 639.0, 389.0),
        (0.0, 245.0, 58.0, 388.0),
    ],
    "zidane.jpg": [(60.0, 90.0, 500.0, 475.0), (430.0, 30.0, 640.0, 475.0)],
}
CUTOUTS: dict[str, list[int]] = {"bus.jpg": [0, 1, 2], "zidane.jpg": [0, 1]}


@dataclass(frozen=True)
class Sprite:
    """A cut-out: BGR pixels and a 0..1 mask of the same height and width."""

    image: np.ndarray
    mask: np.ndarray


@dataclass(frozen=True)
class Sample:
    name: str
    image: np.ndarray  # BGR, SAMPLE_SIZE
    persons: list[Box]


def assets_dir() -> Path:
    """Where the installed ``ultralytics`` keeps ``bus.jpg`` and ``zidane.jpg``."""
    import importlib.util

    spec = importlib.util.find_spec("ultralytics")
    if spec is None or spec.origin is None:
        raise RuntimeError("ultralytics is not installed: its sample images are the source")
    return Path(spec.origin).parent / "assets"


@functools.cache
def samples() -> tuple[Sample, ...]:
    out = []
    for name, persons in SAMPLE_PERSONS.items():
        image = cv2.imread(str(assets_dir() / name))
        if image is None:
            raise RuntimeError(f"cannot read {assets_dir() / name}")
        out.append(Sample(name, cv2.resize(image, SAMPLE_SIZE), persons))
    return tuple(out)


def _cut_out(image: np.ndarray, box: Box) -> Sprite:
    """GrabCut seeded with the box: the person without most of the background around them."""
    x1, y1, x2, y2 = (round(v) for v in box)
    x2, y2 = min(x2, image.shape[1]), min(y2, image.shape[0])
    mask = np.zeros(image.shape[:2], np.uint8)
    rect = (x1 + 1, y1 + 1, x2 - x1 - 2, y2 - y1 - 2)
    bgd, fgd = np.zeros((1, 65), np.float64), np.zeros((1, 65), np.float64)
    cv2.setRNGSeed(0)
    cv2.grabCut(image, mask, rect, bgd, fgd, 3, cv2.GC_INIT_WITH_RECT)
    fg = np.isin(mask, (cv2.GC_FGD, cv2.GC_PR_FGD)).astype(np.uint8)[y1:y2, x1:x2]
    if fg.mean() < 0.2:  # GrabCut lost the person: fall back to the rectangle
        fg[:] = 1
    soft = cv2.GaussianBlur(fg.astype(np.float32), (5, 5), 0)
    return Sprite(image[y1:y2, x1:x2].copy(), soft)


@functools.cache
def person_sprites() -> tuple[Sprite, ...]:
    """The five whole people of the two samples, cut out once per process."""
    return tuple(
        _cut_out(s.image, s.persons[i]) for s in samples() for i in CUTOUTS.get(s.name, [])
    )


def _free_rect(rng: np.random.Generator, sample: Sample, min_side: int) -> tuple[int, ...]:
    """A rectangle of ``sample`` that overlaps none of its persons (or the top band)."""
    w, h = SAMPLE_SIZE
    for _ in range(50):
        rw, rh = int(rng.integers(min_side, w // 2)), int(rng.integers(min_side, h // 2))
        x, y = int(rng.integers(0, w - rw)), int(rng.integers(0, h - rh))
        if all(x + rw <= b[0] or x >= b[2] or y + rh <= b[1] or y >= b[3] for b in sample.persons):
            return x, y, rw, rh
    return 0, 0, w, min(h, 160)  # above every person in both samples


def background(rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
    """One person-free BGR background of ``size`` (w, h): one of four kinds."""
    w, h = size
    kind = int(rng.integers(0, 4))
    if kind == 0:  # coloured noise, smoothed to some random grain
        noise = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        return cv2.resize(noise, (w, h), interpolation=cv2.INTER_CUBIC)
    if kind == 1:  # a two-colour gradient in a random direction
        a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        angle = rng.uniform(0, np.pi)
        yy, xx = np.mgrid[0:h, 0:w]
        t = (np.cos(angle) * xx / w + np.sin(angle) * yy / h) % 1.0
        return (a * (1 - t[..., None]) + b * t[..., None]).astype(np.uint8)
    if kind == 2:  # a drawn scene: ground, walls, windows, poles
        return _drawn_scene(rng, size)
    sample = samples()[int(rng.integers(0, len(samples())))]
    x, y, rw, rh = _free_rect(rng, sample, 80)
    crop = sample.image[y : y + rh, x : x + rw]
    return cv2.resize(crop, (w, h), interpolation=cv2.INTER_LINEAR)


def _drawn_scene(rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
    w, h = size
    image = np.empty((h, w, 3), np.uint8)
    horizon = int(rng.uniform(0.3, 0.7) * h)
    image[:horizon] = rng.integers(0, 256, 3)
    image[horizon:] = rng.integers(0, 256, 3)
    for _ in range(int(rng.integers(2, 8))):
        x1, y1 = int(rng.integers(0, w)), int(rng.integers(0, horizon + 1))
        x2, y2 = x1 + int(rng.integers(10, w // 2)), y1 + int(rng.integers(10, h // 2))
        cv2.rectangle(image, (x1, y1), (x2, y2), rng.integers(0, 256, 3).tolist(), -1)
    for _ in range(int(rng.integers(0, 6))):
        p1 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        p2 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        cv2.line(image, p1, p2, rng.integers(0, 256, 3).tolist(), int(rng.integers(1, 6)))
    for _ in range(int(rng.integers(0, 3))):
        centre = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        radius = int(rng.integers(5, h // 4))
        cv2.circle(image, centre, radius, rng.integers(0, 256, 3).tolist(), -1)
    return image


def _decoy(rng: np.random.Generator) -> Sprite:
    """A person-free patch under an ellipse mask: pasted like a person, never labelled."""
    sample = samples()[int(rng.integers(0, len(samples())))]
    x, y, rw, rh = _free_rect(rng, sample, 40)
    patch = sample.image[y : y + rh, x : x + rw].copy()
    if rng.random() < 0.3:  # rectangles too, or "a pasted rectangle" would mean a person
        return Sprite(patch, np.ones((rh, rw), np.float32))
    mask = np.zeros((rh, rw), np.float32)
    cv2.ellipse(mask, (rw // 2, rh // 2), (rw // 2 - 1, rh // 2 - 1), 0, 0, 360, 1.0, -1)
    return Sprite(patch, cv2.GaussianBlur(mask, (5, 5), 0))


def paste(canvas: np.ndarray, sprite: Sprite, box: Box) -> None:
    """Blend ``sprite`` scaled into ``box`` (clipped to the canvas) in place."""
    x1, y1, x2, y2 = (round(v) for v in box)
    w, h = max(x2 - x1, 2), max(y2 - y1, 2)
    image = cv2.resize(sprite.image, (w, h), interpolation=cv2.INTER_AREA)
    mask = cv2.resize(sprite.mask, (w, h), interpolation=cv2.INTER_LINEAR)[..., None]
    cx1, cy1 = max(x1, 0), max(y1, 0)
    cx2, cy2 = min(x1 + w, canvas.shape[1]), min(y1 + h, canvas.shape[0])
    if cx2 <= cx1 or cy2 <= cy1:
        return
    region = canvas[cy1:cy2, cx1:cx2].astype(np.float32)
    src = image[cy1 - y1 : cy2 - y1, cx1 - x1 : cx2 - x1].astype(np.float32)
    m = mask[cy1 - y1 : cy2 - y1, cx1 - x1 : cx2 - x1]
    canvas[cy1:cy2, cx1:cx2] = (src * m + region * (1 - m)).astype(np.uint8)


def clip_box(box: Box, size: tuple[int, int]) -> Box | None:
    """``box`` inside the frame; None when less than a third of it is visible."""
    w, h = size
    x1, y1, x2, y2 = max(box[0], 0), max(box[1], 0), min(box[2], w), min(box[3], h)
    area = (box[2] - box[0]) * (box[3] - box[1])
    if x2 <= x1 or y2 <= y1 or (x2 - x1) * (y2 - y1) < area / 3:
        return None
    return (x1, y1, x2, y2)


def _place(rng: np.random.Generator, sprite: Sprite, size: tuple[int, int]) -> Box:
    w, h = size
    height = rng.uniform(0.25, 0.95) * h
    width = height * sprite.image.shape[1] / sprite.image.shape[0] * rng.uniform(0.85, 1.15)
    if width > 0.9 * w:  # a wide cut-out: shrink it whole rather than squash it
        height, width = height * 0.9 * w / width, 0.9 * w
    x1 = rng.uniform(-0.1 * width, w - 0.9 * width)
    y1 = rng.uniform(0, max(h - height, 1))
    return (x1, y1, x1 + width, y1 + height)


def _jitter(rng: np.random.Generator, sprite: Sprite) -> Sprite:
    """Mirror and re-light a cut-out so five people look like more; one in four keeps its
    whole rectangle (background and all), as a crude crop pasted into a clip would."""
    image = sprite.image[:, ::-1] if rng.random() < 0.5 else sprite.image
    mask = sprite.mask[:, ::-1] if image is not sprite.image else sprite.mask
    if rng.random() < 0.25:
        mask = np.ones_like(mask)
    gain, bias = rng.uniform(0.6, 1.4), rng.uniform(-30, 30)
    lit = np.clip(image.astype(np.float32) * gain + bias, 0, 255).astype(np.uint8)
    return Sprite(lit, np.ascontiguousarray(mask))


def _whole_sample(rng: np.random.Generator, size: tuple[int, int]) -> tuple[np.ndarray, list[Box]]:
    """A sample image itself, mirrored at random: the real scenes the test clips show."""
    sample = samples()[int(rng.integers(0, len(samples())))]
    sx, sy = size[0] / SAMPLE_SIZE[0], size[1] / SAMPLE_SIZE[1]
    image = cv2.resize(sample.image, size, interpolation=cv2.INTER_AREA)
    boxes = [(b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy) for b in sample.persons]
    if rng.random() < 0.5:
        image = np.ascontiguousarray(image[:, ::-1])
        boxes = [(size[0] - b[2], b[1], size[0] - b[0], b[3]) for b in boxes]
    return image, boxes


def frame(
    rng: np.random.Generator, size: tuple[int, int], persons: int | None = None
) -> tuple[np.ndarray, list[Box]]:
    """One synthetic frame and its person boxes. ``persons=None``: 0-3 people, or (one frame
    in eight) a whole sample image; ``persons=0``: a negative, decoys only."""
    if persons is None and rng.random() < 0.125:
        return _whole_sample(rng, size)
    if persons is None:
        persons = int(rng.choice([0, 1, 1, 2, 2, 3]))
    canvas = background(rng, size)
    for _ in range(int(rng.integers(0, 3))):
        decoy = _decoy(rng)
        paste(canvas, decoy, _place(rng, decoy, size))
    sprites = person_sprites()
    boxes: list[Box] = []
    for _ in range(persons):
        sprite = _jitter(rng, sprites[int(rng.integers(0, len(sprites)))])
        box = _place(rng, sprite, size)
        paste(canvas, sprite, box)
        visible = clip_box(box, size)
        if visible is not None:
            boxes.append(visible)
    return canvas, boxes


def clip(
    rng: np.random.Generator, size: tuple[int, int], frames: int, persons: int = 1
) -> list[tuple[np.ndarray, list[Box]]]:
    """``frames`` frames of one background with ``persons`` people walking across it."""
    w = size[0]
    base = background(rng, size)
    walkers = []
    for _ in range(persons):
        sprite = _jitter(rng, person_sprites()[int(rng.integers(0, len(person_sprites())))])
        x1, y1, x2, y2 = _place(rng, sprite, size)
        start, end = rng.uniform(-0.2, 0.3) * w, rng.uniform(0.5, 1.0) * w - (x2 - x1)
        if rng.random() < 0.5:
            start, end = end, start
        walkers.append((sprite, x2 - x1, y1, y2, start, end))
    out = []
    for i in range(frames):
        t = i / max(frames - 1, 1)
        canvas = base.copy()
        boxes = []
        for sprite, width, y1, y2, start, end in walkers:
            x = start + (end - start) * t
            paste(canvas, sprite, (x, y1, x + width, y2))
            visible = clip_box((x, y1, x + width, y2), size)
            if visible is not None:
                boxes.append(visible)
        out.append((canvas, boxes))
    return out


def yolo_label(boxes: list[Box], size: tuple[int, int]) -> str:
    """YOLO's text format: ``class cx cy w h``, normalised, one person per line."""
    w, h = size
    lines = [
        f"0 {(b[0] + b[2]) / 2 / w:.6f} {(b[1] + b[3]) / 2 / h:.6f} "
        f"{(b[2] - b[0]) / w:.6f} {(b[3] - b[1]) / h:.6f}"
        for b in boxes
    ]
    return "\n".join(lines) + ("\n" if lines else "")


def write_split(
    root: Path, split: str, rng: np.random.Generator, count: int, size: tuple[int, int]
) -> None:
    """``count`` frames under ``root/images/split`` with labels under ``root/labels/split``;
    one frame in four comes from a short walking clip (consecutive positions)."""
    images, labels = root / "images" / split, root / "labels" / split
    images.mkdir(parents=True, exist_ok=True)
    labels.mkdir(parents=True, exist_ok=True)
    i = 0
    while i < count:
        if rng.random() < 0.25:
            batch = clip(rng, size, min(4, count - i), persons=int(rng.integers(1, 3)))
        else:
            batch = [frame(rng, size)]
        for image, boxes in batch:
            cv2.imwrite(str(images / f"{i:05d}.jpg"), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
            (labels / f"{i:05d}.txt").write_text(yolo_label(boxes, size))
            i += 1


def write_dataset(
    root: Path, seed: int, train: int, val: int, size: tuple[int, int] = (320, 240)
) -> Path:
    """A YOLO-format dataset (one class, ``person`` = 0 as in COCO); returns ``data.yaml``.
    Train and val frames come from different generators, so val is held out."""
    seeds = np.random.SeedSequence(seed).spawn(2)
    write_split(root, "train", np.random.default_rng(seeds[0]), train, size)
    write_split(root, "val", np.random.default_rng(seeds[1]), val, size)
    data = root / "data.yaml"
    data.write_text(
        f"path: {root.resolve()}\ntrain: images/train\nval: images/val\nnames:\n  0: person\n"
    )
    return data
