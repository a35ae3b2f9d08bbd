"""Replica discovery: where the pool's members come from, kept current while traffic flows.

Three modes (``discovery.mode`` in the config):

* ``static``: the config's ``replicas`` list only (changed by a reload, see router/lifecycle.py);
* ``dns``: ``discovery.name`` (a Kubernetes headless Service, a compose service name, any
  name with several A/AAAA records) is re-resolved every ``discovery.interval_s``; each
  address is one replica ``<scheme>://<address>:<discovery.port>`` serving
  ``discovery.models``, with the id ``<address>:<port>`` (the same on every router, so
  routers sharing a Redis index agree on names);
* ``kubernetes``: the EndpointSlices of the Service ``discovery.name`` are read from the API
  server (in-cluster service-account credentials, plain HTTPS with aiohttp: no extra
  package); only endpoints whose ``ready`` condition is not false count. Needs RBAC to
  ``list`` ``endpointslices`` (deploy/kubernetes/rbac.yaml).

The config's ``replicas`` are always kept alongside the discovered ones. New replicas are
health-checked before use, vanished ones are drained (no new requests; in-flight ones
finish) and their index entries dropped — both by :meth:`router.pool.Pool.set_replicas`.
A failed resolution keeps the current members (a DNS outage must not empty the pool); an
answer with no records does empty it.

The resolver is injectable: any ``async (name, port) -> [(host, port), ...]`` callable,
so tests drive membership without a DNS server. Pure helpers: :func:`replicas_for`,
:func:`parse_endpoint_slices`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from router.config import Config, DiscoveryConfig, ReplicaConfig
from router.pool import Pool
from router.tasks import stop_task

log = logging.getLogger("kvrouter.discovery")

Endpoint = tuple[str, int]
Resolver = Callable[[str, int], Awaitable[list[Endpoint]]]

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


# ---------------------------------------------------------------------- pure helpers


def endpoint_id(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def replicas_for(endpoints: Sequence[Endpoint], dc: DiscoveryConfig) -> list[ReplicaConfig]:
    """One replica per distinct endpoint, in sorted order (stable across routers)."""
    out = []
    for host, port in sorted(set(endpoints)):
        eid = endpoint_id(host, port)
        out.append(ReplicaConfig(id=eid, url=f"{dc.scheme}://{eid}", models=tuple(dc.models),
                                 api_key=dc.api_key))
    return out


def merge(static: Sequence[ReplicaConfig], found: Sequence[ReplicaConfig]) -> list[ReplicaConfig]:
    """The config's replicas, then the discovered ones whose id or URL is not already there."""
    ids = {r.id for r in static}
    urls = {r.url for r in static}
    return [*static, *(r for r in found if r.id not in ids and r.url not in urls)]


def parse_endpoint_slices(doc: Mapping[str, Any], port_name: str | None = None,
                          default_port: int = 8000) -> list[Endpoint]:
    """Ready endpoints of a ``discovery.k8s.io/v1`` EndpointSliceList: ``[(address, port)]``."""
    out: set[Endpoint] = set()
    for item in doc.get("items") or []:
        ports = [p for p in (item.get("ports") or []) if isinstance(p, Mapping)]
        port = default_port
        if port_name is not None:
            named = [p for p in ports if p.get("name") == port_name]
            if not named:
                continue
            port = int(named[0].get("port") or default_port)
        elif ports and ports[0].get("port"):
            port = int(ports[0]["port"])
        for ep in item.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False:
                continue
            for addr in ep.get("addresses") or []:
                out.add((str(addr), port))
    return sorted(out)


# ---------------------------------------------------------------------- resolvers


async def dns_resolver(name: str, port: int) -> list[Endpoint]:
    """Every A/AAAA record of ``name`` (through the system resolver), each on ``port``."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({(str(info[4][0]), port) for info in infos})


class KubernetesResolver:
    """EndpointSlices of a Service from the in-cluster API server (token re-read each call)."""

    def __init__(self, namespace: str | None, port_name: str | None, sa_dir: Path = SA_DIR,
                 api_url: str | None = None, timeout_s: float = 5.0) -> None:
        self.sa_dir = sa_dir
        self.namespace = namespace or self._read("namespace") or "default"
        self.port_name = port_name
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.api_url = api_url or f"https://{endpoint_id(host, int(port))}"
        self.timeout_s = timeout_s

    def _read(self, name: str) -> str:
        try:
            return (self.sa_dir / name).read_text().strip()
        except OSError:
            return ""

    async def __call__(self, name: str, port: int) -> list[Endpoint]:
        url = (f"{self.api_url}/apis/discovery.k8s.io/v1/namespaces/{quote(self.namespace)}/endpointslices"
               f"?labelSelector={quote('kubernetes.io/service-name=' + name)}")
        headers = {"Accept": "application/json"}
        if token := self._read("token"):
            headers["Authorization"] = f"Bearer {token}"
        ca = self.sa_dir / "ca.crt"
        ctx: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca.exists() else True
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as s, \
                s.get(url, headers=headers, ssl=ctx) as r:
            if r.status != 200:
                raise RuntimeError(f"EndpointSlice list: HTTP {r.status}: {(await r.text())[:200]}")
            doc = await r.json(content_type=None)
        return parse_endpoint_slices(doc, self.port_name, port)


def default_resolver(dc: DiscoveryConfig) -> Resolver | None:
    if dc.mode == "dns":
        return dns_resolver
    if dc.mode == "kubernetes":
        return KubernetesResolver(dc.namespace, dc.port_name)
    return None


# ---------------------------------------------------------------------- the loop


class Discovery:
    """Keeps ``pool`` equal to the config's replicas plus what the resolver finds.

    ``resolver`` may be replaced before :meth:`start` (tests inject one); ``refresh()`` runs
    one round; ``apply(config)`` follows a reloaded config."""

    def __init__(self, config: Config, pool: Pool, resolver: Resolver | None = None) -> None:
        self.dc = config.discovery
        self.static = tuple(config.replicas)
        self.pool = pool
        self._custom = resolver is not None
        self.resolver = resolver if resolver is not None else default_resolver(self.dc)
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.rounds = 0
        self.failures = 0
        self.last_error = ""
        self.endpoints: list[Endpoint] = []

    @property
    def enabled(self) -> bool:
        return self.dc.mode != "static"

    async def refresh(self) -> tuple[list[str], list[str]]:
        """One round: resolve, then set the pool's members; (added, removed) ids."""
        async with self._lock:
            found: list[ReplicaConfig] = []
            if self.enabled and self.resolver is not None:
                try:
                    async with asyncio.timeout(max(1.0, self.dc.interval_s)):
                        self.endpoints = list(await self.resolver(self.dc.name, self.dc.port))
                except Exception as exc:  # keep the members we have
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("discovery: resolving %s failed (%s); keeping %d replicas", self.dc.name,
                                self.last_error, len(self.pool.replicas()))
                    return [], []
                self.last_error = ""
                found = replicas_for(self.endpoints, self.dc)
            self.rounds += 1
            return await self.pool.set_replicas(merge(self.static, found))

    async def start(self) -> None:
        if not self.enabled or self._task is not None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.dc.interval_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("discovery round failed")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def apply(self, config: Config) -> tuple[list[str], list[str]]:
        """Follow a reloaded config: new static replicas and discovery settings, one round now."""
        await self.close()
        mode_changed = config.discovery.mode != self.dc.mode
        self.dc = config.discovery
        self.static = tuple(config.replicas)
        if mode_changed and not self._custom:
            self.resolver = default_resolver(self.dc)
        changes = await self.refresh()
        if self.enabled:
            self._task = asyncio.create_task(self._loop())
        return changes
