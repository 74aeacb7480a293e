"""The detector: real ultralytics YOLO26n, batched across cameras, offline."""

from __future__ import annotations

import os
import time

import pytest
from pipeline_helpers import people_images

from pipelines.config import DetectorConfig, DetectorOverrides
from pipelines.detect import Detection, DetectorError, InjectedDetections, resolve_weights
from pipelines.ingest import Frame

pytestmark = pytest.mark.timeout(120)


def frames(*cameras: str) -> list[Frame]:
    images = people_images()
    return [Frame(cam, i, time.time(), images[i % 2]) for i, cam in enumerate(cameras)]


def test_ultralytics_is_told_to_stay_offline() -> None:
    import pipelines  # noqa: F401

    assert os.environ["YOLO_OFFLINE"] == "1"
    assert os.environ["YOLO_AUTOINSTALL"] == "False"


def test_missing_weights_fail_with_advice_instead_of_downloading(tmp_path) -> None:
    with pytest.raises(DetectorError) as err:
        resolve_weights(str(tmp_path / "yolo26n.pt"))
    message = str(err.value)
    assert "detector.weights" in message and ".yaml" in message and "downloads are off" in message
    assert not (tmp_path / "yolo26n.pt").exists()


def test_downloads_are_opt_in() -> None:
    from pipelines.detect import download_allowed

    assert DetectorConfig().download is False
    assert not download_allowed(False)  # YOLO_OFFLINE=1, this package's default
    assert download_allowed(True)


@pytest.mark.timeout(180)
def test_an_opted_in_download_fetches_or_fails_naming_the_asset(tmp_path, monkeypatch) -> None:
    """Online, ultralytics fetches yolo26n.pt; offline (as here), a DetectorError says the
    download failed -- never a hang, never a half-written file taken for weights."""
    monkeypatch.chdir(tmp_path)
    try:
        path = resolve_weights("yolo26n.pt", download=True)
    except DetectorError as exc:
        assert "downloading 'yolo26n.pt' failed" in str(exc)
        assert os.environ["YOLO_OFFLINE"] == "1"  # the opt-in lasted for the attempt only
    else:
        assert path.endswith("yolo26n.pt") and os.path.getsize(path) > 1e6


def test_a_model_yaml_builds_an_untrained_model(detector) -> None:
    assert detector.names[0] == "person"
    assert detector.calls >= 1  # warmed up at construction


def test_one_model_call_per_batch_across_cameras(detector) -> None:
    before = detector.calls
    out = detector.detect(frames("a", "b", "c"))
    assert detector.calls == before + 1
    assert len(out) == 3 and all(isinstance(dets, list) for dets in out)


def test_cameras_with_another_imgsz_run_as_their_own_sub_batch(detector) -> None:
    before = detector.calls
    detector.detect(frames("a", "b"), {"b": DetectorOverrides(imgsz=256)})
    assert detector.calls == before + 2


def test_class_and_confidence_filters_apply_per_camera(detector) -> None:
    fake = Detection(0, "person", 0.5, (0, 0, 10, 10))
    other = Detection(2, "car", 0.9, (0, 0, 10, 10))

    class Result:  # what ultralytics returns, reduced to what _boxes reads
        def __init__(self) -> None:
            import torch

            class Boxes:
                xyxy = torch.tensor([fake.box, other.box])
                conf = torch.tensor([fake.conf, other.conf])
                cls = torch.tensor([0.0, 2.0])

                def __len__(self) -> int:
                    return 2

            self.boxes = Boxes()

    original = detector._predict
    detector._predict = lambda images, *a: [Result() for _ in images]
    try:
        out = detector.detect(
            frames("a", "b", "c"),
            {"b": DetectorOverrides(conf=0.6), "c": DetectorOverrides(classes=[0, 2])},
        )
    finally:
        detector._predict = original
    assert [d.cls for d in out[0]] == [0]  # default: person only
    assert out[1] == []  # person below this camera's conf
    assert sorted(d.cls for d in out[2]) == [0, 2]


def test_injected_detections_run_the_real_model_first(detector) -> None:
    seen: list[int] = []

    def inject(frame: Frame, real: list[Detection]) -> list[Detection]:
        seen.append(len(real))
        return [Detection(0, "person", 0.9, (1.0, 2.0, 3.0, 4.0))]

    wrapped = InjectedDetections(detector, inject)
    before = detector.calls
    out = wrapped.detect(frames("a", "b"))
    assert detector.calls == before + 1 and len(seen) == 2
    assert [len(d) for d in out] == [1, 1]


def test_untrained_model_finds_no_people_on_real_photos(detector) -> None:
    """Why the end-to-end tests inject detections: built from yolo26n.yaml, the head's class
    bias starts at YOLO's prior (5 objects an image over 80 classes: scores of 1e-5 to 1e-3
    by stride), far under the default confidence, so real photos of people give no detection
    at all."""
    out = detector.detect(frames("a", "b"))
    assert out == [[], []]


def test_detector_config_defaults_to_trained_weights_and_person() -> None:
    cfg = DetectorConfig()
    assert cfg.weights == "yolo26n.pt" and cfg.classes == [0]


def _det(box: tuple[float, float, float, float], conf: float, cls: int = 0) -> Detection:
    return Detection(cls, "person" if cls == 0 else str(cls), conf, box)


def test_a_duplicate_box_of_the_same_person_is_dropped() -> None:
    """YOLO26's end-to-end head skips NMS; the nested second box a weak model gives (the
    synthetic detector's, IoU 0.69 with the person's box) is dropped at the default IoU, a
    second person beside it, another class on top of it and a box under the IoU stay."""
    from pipelines.detect import drop_duplicates

    iou, nested_share = DetectorConfig().iou, DetectorConfig().nested
    person = _det((31, 143, 179, 474), 0.49)
    nested = _det((44, 187, 170, 457), 0.13)  # IoU 0.694 with ``person``
    beside = _det((300, 140, 440, 470), 0.30)
    partial = _det((119, 142, 218, 350), 0.11)  # a head-and-torso box inside: IoU 0.41
    bag = _det((44, 187, 170, 457), 0.20, cls=24)
    kept = drop_duplicates([person, nested, beside, partial, bag], iou)
    assert kept == [person, beside, partial, bag]  # order kept, only the duplicate gone
    assert drop_duplicates([nested, person], iou) == [person]  # the better score wins
    assert drop_duplicates([person, nested], 1.0) == [person, nested]  # 1: every box kept
    assert drop_duplicates([], iou) == [] and drop_duplicates([person], iou) == [person]
    # nested parts: the boxes the detector trained on a Zen 5 gave (wholly inside, a quarter
    # of the person's score) go; a second person inside the box who scores about as high (a
    # child in front of an adult), a part box of another class and one half outside stay
    walker = _det((212, 145, 354, 443), 0.491)
    torso = _det((237, 156, 324, 352), 0.12)
    child = _det((240, 250, 330, 443), 0.40)
    bag_inside = _det((237, 156, 324, 352), 0.12, cls=24)
    half_out = _det((300, 150, 420, 350), 0.10)  # 45 % of it inside the walker's box
    boxes = [walker, torso, child, bag_inside, half_out]
    assert drop_duplicates(boxes, iou, nested_share) == [walker, child, bag_inside, half_out]
    assert drop_duplicates(boxes, iou, None) == boxes  # null keeps nested boxes
    assert drop_duplicates([walker, torso], 1.0, nested_share) == [walker]  # without NMS too
    # the detector trained on a Zen 3 EPYC: a box wholly inside the walker's at IoU 0.60
    # (under the NMS IoU), scoring 1.6x above or below it: one object, the better box stays
    outer = _det((101, 113, 254, 455), 0.145)
    inner = _det((112, 166, 229, 433), 0.236)
    assert drop_duplicates([outer, inner], iou, nested_share) == [inner]
    outer_best = _det((101, 113, 254, 455), 0.254)
    assert drop_duplicates([outer_best, inner], iou, nested_share) == [outer_best]
    assert drop_duplicates([outer, inner], iou, None) == [outer, inner]  # null keeps them


def test_detector_iou_is_validated() -> None:
    assert DetectorConfig(iou=1.0).iou == 1.0
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="iou"):
            DetectorConfig(iou=bad)
    assert DetectorConfig(nested=None).nested is None and DetectorConfig(nested=1.0).nested == 1
    for bad in (0.0, 1.2, "most"):
        with pytest.raises(ValueError, match="nested"):
            DetectorConfig(nested=bad)
