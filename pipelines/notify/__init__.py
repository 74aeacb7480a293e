"""Notifications: each description sent to MQTT (with Home Assistant discovery) and webhooks.

``vision-serve notify --config cameras.yaml`` reads the descriptions stream and delivers every
described frame to every sink configured under ``notify:``, at least once:

- ``notifier.py`` -- one consumer group per sink; an entry is acknowledged for a sink only
  once that sink has it (delivered, or dead-lettered with its reason in ``vs:notify:dead``).
- ``event.py`` -- the JSON body, the same on every sink; ``event_id`` (the frame's
  ``frame_uid``) is what receivers de-duplicate on: a repeat always carries the same id.
- ``mqtt.py`` -- topics, QoS 1 with PUBACK, retained ``last_event``, discovery, LWT.
- ``webhook.py`` -- the signed POST (``X-Vision-Serve-Signature``), retries, dead letters.
- ``config.py`` -- the ``notify:`` section; ``metrics.py`` -- the counters.

Kept light: ``pipelines.config`` imports ``notify.config`` for its section.
"""
