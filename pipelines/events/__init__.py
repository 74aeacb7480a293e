"""Events: every description becomes a stored, searchable event with its snapshot.

``vision-serve ui --config cameras.yaml`` runs three things in one process:

- ``consumer.py``: its own consumer group (``events.group``) on the descriptions stream,
  created from id 0; each description is written to the store (SQLite + snapshots on disk)
  and acknowledged only after the SQLite commit. Re-delivery after a crash finds the event
  by id (``frame_uid``) and adds nothing: at-least-once delivery + idempotent insert =
  exactly one event per described frame.
- ``retention.py``: deletes events past ``retain_days`` and, per camera, the oldest ones
  past ``max_snapshot_mb`` of snapshots; every deletion is counted.
- ``app.py``: the REST API (``/api/events``, ``/api/cameras``, SSE, re-describe) and the
  events page (``static/``), behind the same Bearer-key rule as the VLM server.

Kept light at import: ``pipelines.config`` imports ``events.config`` from here.
"""
