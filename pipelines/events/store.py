"""The event store: one SQLite file (WAL) with an FTS5 index over the text, snapshots on disk.

Layout under ``events.data_dir``::

    events.db                               events, their description history, counters
    snapshots/<camera>/<YYYY-MM-DD>/<uid>.jpg         the frame as the describer saw it
    snapshots/<camera>/<YYYY-MM-DD>/<uid>.boxes.jpg   the same with the detector's boxes

Why these choices:

- The event id is the frame's ``frame_uid`` (unique per frame, kept across retried sends), and
  it is ``UNIQUE`` in the table: a description delivered twice (a crash between the SQLite
  commit and the ``XACK``) is inserted once (``INSERT OR IGNORE``, counted ``duplicate``).
- ``seq`` is ``AUTOINCREMENT``: never reused after a deletion, so it is a safe cursor for the
  live stream (``after(seq)``) and the FTS5 rowid.
- The FTS5 table is external-content (the text is stored once, in ``events``) and kept in
  sync by triggers, so every insert, re-description and retention delete updates the index in
  the same transaction.
- WAL lets the API read while the consumer writes; writers take ``BEGIN IMMEDIATE`` (no
  read-to-write upgrade deadlocks) and wait on each other (``busy_timeout``).
  ``synchronous=FULL``: a commit is on disk before the entry is acknowledged in Redis, so a
  power cut cannot lose an acknowledged event.
- Snapshots are written before the row (temp file + rename), so a row never names a file that
  is not there; retention unlinks files before deleting rows, so a crash leaves at worst a row
  without its snapshot (served as 404), never a file the disk budget cannot see.

Descriptions are untrusted text (SECURITY.md): they only ever reach SQL as bound parameters.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import re
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import cv2
import numpy as np

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    camera TEXT NOT NULL,
    ts REAL NOT NULL,
    described_at REAL,
    text TEXT NOT NULL,
    structured TEXT,
    persons INTEGER NOT NULL DEFAULT 0,
    boxes TEXT NOT NULL DEFAULT '[]',
    model TEXT,
    latency_s REAL,
    vlm_seconds REAL,
    completion_tokens INTEGER,
    worker TEXT,
    frame_id TEXT,
    entry_id TEXT,
    width INTEGER,
    height INTEGER,
    snapshot TEXT,
    snapshot_boxes TEXT,
    snapshot_bytes INTEGER NOT NULL DEFAULT 0,
    stored_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_ts ON events(ts, seq);
CREATE INDEX IF NOT EXISTS events_by_camera_ts ON events(camera, ts, seq);

CREATE TABLE IF NOT EXISTS event_history (
    event_seq INTEGER NOT NULL REFERENCES events(seq) ON DELETE CASCADE,
    text TEXT NOT NULL,
    structured TEXT,
    model TEXT,
    described_at REAL,
    replaced_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS event_history_by_event ON event_history(event_seq);

CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- values the consumer keeps across restarts (descriptions_n: the highest entry number read)
CREATE TABLE IF NOT EXISTS marks (name TEXT PRIMARY KEY, value INTEGER NOT NULL);

CREATE VIRTUAL TABLE IF NOT EXISTS events_fts USING fts5(
    text, content='events', content_rowid='seq', tokenize='porter unicode61 remove_diacritics 2'
);
CREATE TRIGGER IF NOT EXISTS events_fts_insert AFTER INSERT ON events BEGIN
    INSERT INTO events_fts(rowid, text) VALUES (new.seq, new.text);
END;
CREATE TRIGGER IF NOT EXISTS events_fts_delete AFTER DELETE ON events BEGIN
    INSERT INTO events_fts(events_fts, rowid, text) VALUES ('delete', old.seq, old.text);
END;
CREATE TRIGGER IF NOT EXISTS events_fts_update AFTER UPDATE OF text ON events BEGIN
    INSERT INTO events_fts(events_fts, rowid, text) VALUES ('delete', old.seq, old.text);
    INSERT INTO events_fts(rowid, text) VALUES (new.seq, new.text);
END;
"""

# API fields: everything but where the files lie (served through the snapshot route)
PUBLIC = (
    "id", "seq", "camera", "ts", "described_at", "text", "structured", "persons", "boxes",
    "model", "latency_s", "vlm_seconds", "completion_tokens", "worker", "frame_id", "width",
    "height",
)  # fmt: skip

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
MAX_TS = 253402300799.0  # 9999-12-31T23:59:59Z


class QueryError(ValueError):
    """A full-text query SQLite cannot parse (the caller's mistake: HTTP 400)."""


def safe_name(part: str) -> str:
    """A path component made of ``[A-Za-z0-9_.-]`` that cannot climb out of its directory;
    a name that had to change gets a hash of the original, so two names never collide."""
    cleaned = _UNSAFE.sub("_", part)[:80].lstrip(".") or "_"
    if cleaned != part:
        cleaned += "-" + hashlib.sha1(part.encode()).hexdigest()[:10]
    return cleaned


def _float(value: str | None) -> float | None:
    try:
        number = float(value) if value not in (None, "") else None
    except ValueError:
        return None
    return number if number is not None and np.isfinite(number) else None


def _int(value: str | None, default: int | None = None) -> int | None:
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        return default


def _json_list(value: str | None) -> str:
    try:
        parsed = json.loads(value or "[]")
    except (json.JSONDecodeError, TypeError):
        return "[]"
    return json.dumps(parsed, separators=(",", ":")) if isinstance(parsed, list) else "[]"


def _structured(fields_: dict[str, str]) -> str | None:
    """A JSON object or list, from a ``structured`` field or a text that is JSON itself."""
    for candidate in (fields_.get("structured"), fields_.get("text", "")):
        if candidate and candidate.lstrip()[:1] in ("{", "["):
            try:
                parsed = json.loads(candidate)
            except json.JSONDecodeError:
                continue
            if isinstance(parsed, dict | list):
                return json.dumps(parsed, separators=(",", ":"))
    return None


@dataclass
class NewEvent:
    """One description on its way into the store (fields of a ``vs:descriptions`` entry)."""

    id: str
    camera: str
    ts: float
    text: str
    described_at: float | None = None
    structured: str | None = None
    persons: int = 0
    boxes: str = "[]"
    model: str | None = None
    latency_s: float | None = None
    vlm_seconds: float | None = None
    completion_tokens: int | None = None
    worker: str | None = None
    frame_id: str | None = None
    entry_id: str | None = None
    width: int | None = None
    height: int | None = None
    snapshot: str | None = None
    snapshot_boxes: str | None = None
    snapshot_bytes: int = 0

    @classmethod
    def from_entry(cls, entry_id: str, f: dict[str, str]) -> NewEvent:
        """Parse a description entry; unreadable numbers become empty, never an exception
        (one odd entry must not stall the stream behind it)."""
        ts = _float(f.get("ts"))
        if ts is None or not 0 <= ts < MAX_TS:  # a day folder must be computable
            ts = time.time()
        return cls(
            id=f.get("frame_uid") or f.get("frame_id") or f"descriptions:{entry_id}",
            camera=f.get("camera") or "unknown",
            ts=ts,
            text=f.get("text", ""),
            described_at=_float(f.get("described_at")),
            structured=_structured(f),
            persons=_int(f.get("persons"), 0) or 0,
            boxes=_json_list(f.get("boxes")),
            model=f.get("model") or None,
            latency_s=_float(f.get("latency_s")),
            vlm_seconds=_float(f.get("vlm_seconds")),
            completion_tokens=_int(f.get("completion_tokens")),
            worker=f.get("worker") or None,
            frame_id=f.get("frame_id") or None,
            entry_id=entry_id,
            width=_int(f.get("width")),
            height=_int(f.get("height")),
        )


def draw_boxes(image: np.ndarray, boxes: list[dict[str, Any]]) -> np.ndarray:
    """The frame with each detection's box and ``label conf`` drawn (a copy)."""
    out = image.copy()
    height, width = out.shape[:2]
    thick = max(2, round(max(height, width) / 320))
    for b in boxes:
        if not isinstance(b, dict):
            continue
        try:
            x1, y1, x2, y2 = (float(v) for v in b["box"])
            # clipped: a box partly outside the frame is drawn at its edge
            x1, x2 = (min(max(round(v), 0), width - 1) for v in (x1, x2))
            y1, y2 = (min(max(round(v), 0), height - 1) for v in (y1, y2))
        except (KeyError, IndexError, TypeError, ValueError, OverflowError):
            continue
        cv2.rectangle(out, (x1, y1), (x2, y2), (0, 200, 0), thick)
        conf = b.get("conf", b.get("score"))
        label = str(b.get("label", b.get("cls", b.get("class", ""))))[:24]
        if isinstance(conf, int | float):
            label = f"{label} {conf:.2f}".strip()
        if label:
            scale = max(0.3, max(height, width) / 800)
            (tw, th), base = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
            top = max(0, y1 - th - base - 2)
            cv2.rectangle(out, (x1, top), (x1 + tw + 2, top + th + base + 2), (0, 200, 0), -1)
            cv2.putText(
                out, label, (x1 + 1, top + th + 1), cv2.FONT_HERSHEY_SIMPLEX, scale,
                (0, 0, 0), 1, cv2.LINE_AA,
            )  # fmt: skip
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


class EventStore:
    """SQLite + snapshot files. Safe to share between threads: each thread gets its own
    connection (WAL: readers never wait for the writer)."""

    def __init__(self, data_dir: str | Path) -> None:
        self.root = Path(data_dir).resolve()
        self.snapshot_root = self.root / "snapshots"
        self.snapshot_root.mkdir(parents=True, exist_ok=True)
        self.db_path = self.root / "events.db"
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        db = self._db()
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    # -- connections -----------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # autocommit mode; writes open their own BEGIN IMMEDIATE (see _write)
            conn = sqlite3.connect(
                self.db_path, timeout=10.0, isolation_level=None, check_same_thread=False
            )
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=FULL")
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        conn = self._db()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        self._local = threading.local()

    @staticmethod
    def _count(conn: sqlite3.Connection, counts: Counter[str]) -> None:
        conn.executemany(
            "INSERT INTO counters(name, value) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            [(k, v) for k, v in counts.items() if v],
        )

    # -- writing -----------------------------------------------------------------------------
    def existing(self, ids: Iterable[str]) -> set[str]:
        ids = list(ids)
        if not ids:
            return set()
        marks = ",".join("?" * len(ids))
        rows = self._db().execute(f"SELECT id FROM events WHERE id IN ({marks})", ids)
        return {r[0] for r in rows}

    def write_snapshots(self, event: NewEvent, jpeg: bytes, quality: int = 85) -> bool:
        """Write the raw JPEG and the one with boxes; fill the event's snapshot fields.

        False when the JPEG does not decode: only the raw file is kept then.
        """
        day = dt.datetime.fromtimestamp(event.ts, dt.UTC).strftime("%Y-%m-%d")
        folder = self.snapshot_root / safe_name(event.camera) / day
        folder.mkdir(parents=True, exist_ok=True)
        stem = safe_name(event.id)
        raw = folder / f"{stem}.jpg"
        _write_atomic(raw, jpeg)
        event.snapshot = str(raw.relative_to(self.root))
        event.snapshot_bytes = len(jpeg)
        image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
        if image is None:
            return False
        event.height, event.width = image.shape[:2]
        drawn = draw_boxes(image, json.loads(event.boxes))
        ok, buf = cv2.imencode(".jpg", drawn, [cv2.IMWRITE_JPEG_QUALITY, quality])
        if not ok:
            return False
        boxed = folder / f"{stem}.boxes.jpg"
        _write_atomic(boxed, buf.tobytes())
        event.snapshot_boxes = str(boxed.relative_to(self.root))
        event.snapshot_bytes += len(buf)
        return True

    def add(
        self,
        events: list[NewEvent],
        counts: Counter[str] | None = None,
        marks: dict[str, int] | None = None,
    ) -> list[int]:
        """Insert events, add ``counts`` to the counters and set ``marks``, in one transaction;
        an id that is already stored is skipped (counted ``duplicate``). Returns the new
        events' seqs."""
        counts = Counter(counts or {})
        names = [f.name for f in fields(NewEvent)]
        sql = (
            f"INSERT OR IGNORE INTO events ({', '.join(names)}, stored_at) "
            f"VALUES ({', '.join('?' * (len(names) + 1))})"
        )
        seqs: list[int] = []
        now = time.time()
        with self._write() as conn:
            for event in events:
                cur = conn.execute(sql, [getattr(event, n) for n in names] + [now])
                if cur.rowcount:
                    seqs.append(int(cur.lastrowid))
                    counts["stored"] += 1
                else:
                    counts["duplicate"] += 1
            self._count(conn, counts)
            conn.executemany(
                "INSERT INTO marks(name, value) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET value = excluded.value",
                list((marks or {}).items()),
            )
        return seqs

    def count(self, counts: Counter[str]) -> None:
        with self._write() as conn:
            self._count(conn, counts)

    def replace_description(
        self, event_id: str, text: str, model: str | None, described_at: float
    ) -> dict[str, Any] | None:
        """A new description for an event; the previous one goes to its history."""
        with self._write() as conn:
            row = conn.execute("SELECT * FROM events WHERE id = ?", (event_id,)).fetchone()
            if row is None:
                return None
            conn.execute(
                "INSERT INTO event_history(event_seq, text, structured, model, described_at, "
                "replaced_at) VALUES (?, ?, ?, ?, ?, ?)",
                (row["seq"], row["text"], row["structured"], row["model"], row["described_at"],
                 time.time()),
            )  # fmt: skip
            conn.execute(
                "UPDATE events SET text = ?, structured = ?, model = ?, described_at = ? "
                "WHERE seq = ?",
                (text, _structured({"text": text}), model, described_at, row["seq"]),
            )
            self._count(conn, Counter(redescribed=1))
        return self.get(event_id)

    def delete(self, rows: list[sqlite3.Row], reason: str) -> int:
        """Delete events (files first, then rows), counted ``deleted:<reason>``."""
        if not rows:
            return 0
        for row in rows:
            for rel in (row["snapshot"], row["snapshot_boxes"]):
                path = self._resolve(rel)
                if path is not None:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    with contextlib.suppress(OSError):  # the day's folder, once empty
                        path.parent.rmdir()
        seqs = [row["seq"] for row in rows]
        with self._write() as conn:
            deleted = 0
            for i in range(0, len(seqs), 500):
                chunk = seqs[i : i + 500]
                marks = ",".join("?" * len(chunk))
                deleted += conn.execute(
                    f"DELETE FROM events WHERE seq IN ({marks})", chunk
                ).rowcount
            self._count(conn, Counter({f"deleted:{reason}": deleted}))
        return deleted

    # -- reading -----------------------------------------------------------------------------
    def get(self, event_id: str) -> dict[str, Any] | None:
        row = self._db().execute("SELECT * FROM events WHERE id = ?", (event_id,)).fetchone()
        return None if row is None else self.public(row)

    def row(self, event_id: str) -> sqlite3.Row | None:
        return self._db().execute("SELECT * FROM events WHERE id = ?", (event_id,)).fetchone()

    def history(self, seq: int) -> list[dict[str, Any]]:
        rows = self._db().execute(
            "SELECT text, structured, model, described_at, replaced_at FROM event_history "
            "WHERE event_seq = ? ORDER BY rowid",
            (seq,),
        )
        return [
            {**dict(r), "structured": json.loads(r["structured"]) if r["structured"] else None}
            for r in rows
        ]

    def list_events(
        self,
        *,
        camera: str | None = None,
        since: float | None = None,
        until: float | None = None,
        q: str | None = None,
        limit: int = 50,
        before: tuple[float, int] | None = None,
    ) -> tuple[list[dict[str, Any]], tuple[float, int] | None]:
        """Events newest first (capture time), and the cursor of the next page (or None)."""
        join, where, args = "", [], []
        if q:
            join = "JOIN events_fts ON events_fts.rowid = e.seq"
            where.append("events_fts MATCH ?")
            args.append(q)
        if camera:
            where.append("e.camera = ?")
            args.append(camera)
        if since is not None:
            where.append("e.ts >= ?")
            args.append(since)
        if until is not None:
            where.append("e.ts < ?")
            args.append(until)
        if before is not None:
            where.append("(e.ts, e.seq) < (?, ?)")
            args += list(before)
        sql = f"SELECT e.* FROM events e {join}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY e.ts DESC, e.seq DESC LIMIT ?"
        try:
            rows = self._db().execute(sql, [*args, limit + 1]).fetchall()
        except sqlite3.OperationalError as exc:
            message = str(exc)
            if not q or any(s in message for s in ("locked", "busy", "disk", "I/O", "readonly")):
                raise
            raise QueryError(message) from None
        more = len(rows) > limit
        rows = rows[:limit]
        cursor = (rows[-1]["ts"], rows[-1]["seq"]) if more and rows else None
        return [self.public(r) for r in rows], cursor

    def after(self, seq: int, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._db().execute(
            "SELECT * FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)
        )
        return [self.public(r) for r in rows]

    def max_seq(self) -> int:
        return int(self._db().execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0])

    def latest_per_camera(self) -> dict[str, dict[str, Any]]:
        rows = self._db().execute(
            "SELECT e.* FROM events e JOIN (SELECT camera, max(ts) AS ts FROM events "
            "GROUP BY camera) m ON e.camera = m.camera AND e.ts = m.ts ORDER BY e.seq"
        )
        return {r["camera"]: self.public(r) for r in rows}  # ties: the later seq wins

    def cameras(self) -> list[str]:
        return [r[0] for r in self._db().execute("SELECT DISTINCT camera FROM events")]

    def counters(self) -> dict[str, int]:
        rows = self._db().execute("SELECT name, value FROM counters ORDER BY name")
        return {r[0]: int(r[1]) for r in rows}

    def mark(self, name: str) -> int | None:
        row = self._db().execute("SELECT value FROM marks WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    def count_events(self) -> int:
        return int(self._db().execute("SELECT count(*) FROM events").fetchone()[0])

    # -- retention queries -------------------------------------------------------------------
    def older_than(self, camera: str, cutoff: float, limit: int = 500) -> list[sqlite3.Row]:
        return (
            self._db()
            .execute(
                "SELECT seq, snapshot, snapshot_boxes, snapshot_bytes FROM events "
                "WHERE camera = ? AND ts < ? ORDER BY ts, seq LIMIT ?",
                (camera, cutoff, limit),
            )
            .fetchall()
        )

    def snapshot_usage(self, camera: str) -> int:
        row = (
            self._db()
            .execute(
                "SELECT coalesce(sum(snapshot_bytes), 0) FROM events WHERE camera = ?", (camera,)
            )
            .fetchone()
        )
        return int(row[0])

    def oldest_with_snapshots(self, camera: str, limit: int = 500) -> list[sqlite3.Row]:
        return (
            self._db()
            .execute(
                "SELECT seq, snapshot, snapshot_boxes, snapshot_bytes FROM events "
                "WHERE camera = ? AND snapshot_bytes > 0 ORDER BY ts, seq LIMIT ?",
                (camera, limit),
            )
            .fetchall()
        )

    # -- files -------------------------------------------------------------------------------
    def _resolve(self, rel: str | None) -> Path | None:
        """A stored relative path, only if it stays inside the snapshot folder."""
        if not rel:
            return None
        path = (self.root / rel).resolve()
        return path if path.is_relative_to(self.snapshot_root) else None

    def snapshot_file(self, event_id: str, boxes: bool) -> Path | None:
        """The snapshot to serve; with ``boxes`` the drawn one, else (or if there is none,
        e.g. an undecodable JPEG) the raw frame."""
        row = self.row(event_id)
        if row is None:
            return None
        for rel in ([row["snapshot_boxes"]] if boxes else []) + [row["snapshot"]]:
            path = self._resolve(rel)
            if path is not None and path.is_file():
                return path
        return None

    @staticmethod
    def public(row: sqlite3.Row) -> dict[str, Any]:
        out = {k: row[k] for k in PUBLIC}
        out["boxes"] = json.loads(row["boxes"] or "[]")
        out["structured"] = json.loads(row["structured"]) if row["structured"] else None
        out["has_snapshot"] = bool(row["snapshot"])
        return out
