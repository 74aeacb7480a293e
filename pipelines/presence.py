"""Whether a tracked object is *in* a zone: Frigate's zone ``inertia`` and ``loitering_time``.

Why not the frame's own answer: a detector's box jitters, so the bottom centre of someone
walking along a zone's edge flickers in and out of it, and a person passing a door is not a
person waiting at it. So a tracked object is in a zone only after its feet were inside for
``inertia`` frames in a row (Frigate's default 3; 1 = at once), and -- with ``loitering_time``
> 0 -- once it has stayed that many seconds, timed on the frames' timestamps from the first
of those frames. Once in, an excursion shorter than ``inertia`` frames (the edge's jitter)
keeps it in; ``inertia`` frames in a row outside take it out, and coming back counts from
the start again.

Frigate (``frigate/track/tracked_object.py``) enters a zone the same way, but drops an
object on its first frame outside and lets it back in at once, and keeps counting loitering
across visits. Here leaving has the same inertia as entering, and a stay that ends restarts
the loitering clock: passing the door twice is not waiting at it. Frigate's
``entered_zones`` (in at least once) is ``TrackZones.entered``.

Only the frames a track is seen in count: a frame where the detector missed the person
changes nothing (the tracker keeps the id across such gaps). Untracked detections have no
identity whose frames could be counted; see ``config.zone_timing_without_tracks``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from pipelines.config import ZoneConfig

# in: counts as in the zone | loitering: present, loitering_time not yet spent |
# inertia: feet inside, fewer than `inertia` frames in a row so far | outside
Place = Literal["in", "loitering", "inertia", "outside"]


@dataclass
class ZoneStay:
    """One tracked object in one zone."""

    inside: int = 0  # frames in a row seen with its feet inside
    outside: int = 0  # frames in a row seen outside while present
    since: float | None = None  # timestamp of the first inside frame of this stay
    present: bool = False  # inertia met, and not left since

    def update(self, inside: bool, now: float, inertia: int) -> None:
        if inside:
            self.inside += 1
            self.outside = 0
            if self.since is None:
                self.since = now
            if self.inside >= inertia:
                self.present = True
            return
        self.inside = 0
        if not self.present:
            self.since = None  # an entry cut short starts again
            return
        self.outside += 1
        if self.outside >= inertia:
            self.present, self.outside, self.since = False, 0, None

    def place(self, now: float, loitering_time: float) -> Place:
        if self.present:
            assert self.since is not None
            return "in" if now - self.since >= loitering_time else "loitering"
        return "inertia" if self.inside else "outside"


class TrackZones:
    """One tracked object's stay in each zone of its camera; ``update`` once per frame it is
    seen in, with the zones its feet are in on that frame (label rules already applied)."""

    def __init__(self, zones: dict[str, ZoneConfig]) -> None:
        self.zones = zones
        self.stays = {name: ZoneStay() for name in zones}
        self.places: dict[str, Place] = dict.fromkeys(zones, "outside")
        self.entered: set[str] = set()  # zones it has been in (Frigate's entered_zones)

    def update(self, inside: Iterable[str], now: float) -> dict[str, Place]:
        feet = set(inside)
        for name, zone in self.zones.items():
            stay = self.stays[name]
            stay.update(name in feet, now, zone.inertia)
            self.places[name] = stay.place(now, zone.loitering_time)
            if self.places[name] == "in":
                self.entered.add(name)
        return self.places

    def place_among(self, names: Iterable[str]) -> Place:
        """The furthest along of ``names``' places: in one of them, else loitering in one ..."""
        found = {self.places[n] for n in names}
        return next((p for p in ("in", "loitering", "inertia") if p in found), "outside")
