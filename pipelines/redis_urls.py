"""Redis URLs past one box: Sentinel and Cluster, beside the plain ``redis://`` / ``rediss://``.

Why here and not in ``queue.connect``: the asyncio workers (``worker.connect_async``) must
build the same client without importing ``pipelines.queue`` (which brings cv2), so both call
``make_client``; ``queue.connect`` stays the one place the sync side connects.

- ``redis+sentinel://[[user]:password@]host:port[,host2:port2...]/service_name[/db]``
  (``rediss+sentinel://`` for TLS): the master of ``service_name`` as the sentinels name it
  now (``redis.sentinel.Sentinel(...).master_for(...)``), so a failover moves the clients
  with it. The password is the master's; sentinels that want one of their own take
  ``?sentinel_password=...`` (and ``sentinel_username``).
- ``redis+cluster://[[user]:password@]host:port[/0]`` (``rediss+cluster://``): redis-py's
  ``RedisCluster.from_url``. The queue's Lua scripts touch several keys in one call (frames
  stream, stats hash, the frame's JPEG, the camera's latest hash...), which a cluster allows
  only inside one hash slot, so every queue key must carry the same hash tag
  (``{vs}:frames``...): ``cluster_key_problem`` says which does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379
HASH_TAG = re.compile(r"\{([^{}]+)\}")


@dataclass(frozen=True)
class SentinelTarget:
    """What a ``redis+sentinel://`` URL names (``password`` is the master's)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False


def scheme_of(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def is_sentinel(url: str) -> bool:
    return scheme_of(url) in SENTINEL_SCHEMES


def is_cluster(url: str) -> bool:
    return scheme_of(url) in CLUSTER_SCHEMES


def _host_port(item: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; errors never repeat the URL."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError("a sentinel address has no host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"sentinel {host}: the port must be a number in 1-65535")
    return host, int(port_text)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """``redis+sentinel://[[user]:password@]h1:p1[,h2:p2]/service[/db][?sentinel_password=]``."""
    scheme = scheme_of(url)
    if scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a sentinel URL: use {' or '.join(SENTINEL_SCHEMES)}://")
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else unquote(user)
        if not colon:  # redis://secret@host: a password given without the ':'
            username = None
    sentinels = tuple(_host_port(h.strip(), SENTINEL_PORT) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise ValueError("no sentinel host:port given (redis+sentinel://host:26379/mymaster/0)")
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts:
        raise ValueError("no service name: redis+sentinel://host:26379/<service_name>[/db]")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("the path must be /<service_name>[/<db number>]")
    options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = set(options) - {"sentinel_password", "sentinel_username"}
    if unknown:
        allowed = "sentinel_password, sentinel_username"
        raise ValueError(f"unknown option(s) {sorted(unknown)}; allowed: {allowed}")
    return SentinelTarget(
        sentinels=sentinels,
        service=parts[0],
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
        ssl=scheme == "rediss+sentinel",
    )


def cluster_key_problem(keys: dict[str, str]) -> str | None:
    """Why these queue keys (name -> key or prefix) cannot work on a cluster, or None.

    Each must contain the same ``{tag}``: Redis hashes only the tag, so they share a slot.
    """
    tags = {name: HASH_TAG.search(key) for name, key in keys.items()}
    missing = [name for name, m in tags.items() if m is None]
    found = {m.group(1) for m in tags.values() if m is not None}
    if not missing and len(found) == 1:
        return None
    tag = next(iter(found)) if len(found) == 1 else "vs"
    detail = (
        f"no hash tag in queue.{', queue.'.join(missing)}"
        if missing
        else f"different hash tags {sorted(found)}"
    )
    return (
        "Redis Cluster runs a Lua script only on keys of one hash slot, and the queue's "
        "scripts touch several keys at once (frames stream, stats hash, the frame's JPEG, "
        f"the camera's latest hash...): give every queue key the same hash tag, e.g. "
        f"queue.frames_stream: '{{{tag}}}:frames', queue.stats_key: '{{{tag}}}:stats' "
        f"({detail})"
    )


def make_client(url: str, *, asyncio: bool = False, **kwargs: Any) -> Any:
    """A redis-py client (``redis.asyncio`` when ``asyncio``) for any URL form above;
    ``kwargs`` (timeouts, health checks) apply to the data connections."""
    if is_sentinel(url):
        target = parse_sentinel_url(url)
        if asyncio:
            from redis.asyncio.sentinel import Sentinel as AsyncSentinel

            sentinel_cls: Any = AsyncSentinel
        else:
            from redis.sentinel import Sentinel

            sentinel_cls = Sentinel
        timeouts = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
        sentinel_kwargs: dict[str, Any] = {**timeouts, "ssl": target.ssl}
        if target.sentinel_password:
            sentinel_kwargs["password"] = target.sentinel_password
            sentinel_kwargs["username"] = target.sentinel_username
        sentinel = sentinel_cls(
            list(target.sentinels),
            sentinel_kwargs=sentinel_kwargs,
            **kwargs,
        )
        return sentinel.master_for(
            target.service,
            db=target.db,
            username=target.username,
            password=target.password,
            ssl=target.ssl,
        )
    if is_cluster(url):
        plain = url.split("+cluster", 1)[0] + url.split("+cluster", 1)[1]
        if asyncio:
            from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

            return AsyncRedisCluster.from_url(plain, **_cluster_kwargs(kwargs))
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(plain, **_cluster_kwargs(kwargs))
    if asyncio:
        import redis.asyncio as aredis

        return aredis.Redis.from_url(url, **kwargs)
    import redis

    return redis.Redis.from_url(url, **kwargs)


def _cluster_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    # RedisCluster manages its node connections itself; it takes no health_check_interval
    return {k: v for k, v in kwargs.items() if k != "health_check_interval"}
