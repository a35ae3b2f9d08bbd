"""The prefix service: tokenize → hash → index lookup / record, for the router's request path.

Implements the ``PrefixService`` protocol the proxy calls (see ``router/proxy.py``):

* ``annotate(path, body, req)``: the prompt of a ``/v1/completions`` body or the messages
  of a ``/v1/chat/completions`` body → token ids with the model's tokenizer
  (:mod:`router.tokenize`; ``models.<name>.tokenizer``), → chained block hashes
  (``models.<name>.block_size``, seeded by model and the body's ``cache_salt``). Sets
  ``req.hashes``, ``req.num_tokens``, ``req.block_size``; never raises for client content.
* ``lookup(req)``: replica → matched blocks from the index (``{}`` when it is down).
* ``record(req, replica)``: queues the placement (non-blocking; Redis writes are batched).
* ``observe(req, decision, cached_tokens)``: predicted vs engine-measured cached tokens.
* ``replica_removed(replica)``: clears the replica's entries (ejected, or left the pool;
  a replica that left the pool is no longer followed through its KV events).
* ``apply_events(config)``: a reloaded config's ``replicas[].kv_events`` (sources added,
  changed, dropped; see ``docs/kv-events.md``).

The index is ``index.backend`` (``memory`` | ``redis``) from the config; per-replica
capacities come from ``replicas[].capacity_blocks`` (else ``index.capacity_blocks``).
Metrics (on the router's registry) are listed in ``docs/routing.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.config import Config, ReplicaConfig
from router.core.hashing import block_hashes, seed_hash
from router.core.types import Decision, ReplicaState, RoutingRequest
from router.index.base import IndexEvents
from router.index.memory import MemoryIndex
from router.index.redis import RedisIndex
from router.tasks import stop_task
from router.tokenize import BackendTokenizer, ModelTokenizer, load_tokenizer

log = logging.getLogger("kvrouter.prefix")

_TOKEN_BUCKETS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class PrefixMetrics(IndexEvents):
    """The prefix service's Prometheus metrics; also receives the index's events."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prompt_tokens = Counter("kvrouter_prefix_prompt_tokens", "Prompt tokens seen by the prefix "
                                     "service", ["model"], registry=registry)
        self.predicted = Counter("kvrouter_prefix_predicted_hit_tokens", "Prompt tokens the index predicted "
                                 "cached on the chosen replica", ["model"], registry=registry)
        self.measured = Counter("kvrouter_prefix_measured_hit_tokens", "Cached prompt tokens reported by the "
                                "engine (usage.prompt_tokens_details.cached_tokens)", ["model"],
                                registry=registry)
        self.observed = Counter("kvrouter_prefix_observed_requests", "Requests whose engine reported "
                                "cached_tokens", ["model"], registry=registry)
        self.predicted_hist = Histogram("kvrouter_prefix_predicted_tokens", "Predicted cached tokens per "
                                        "request", ["model"], buckets=_TOKEN_BUCKETS, registry=registry)
        self.measured_hist = Histogram("kvrouter_prefix_measured_tokens", "Engine-measured cached tokens "
                                       "per request", ["model"], buckets=_TOKEN_BUCKETS, registry=registry)
        self.unreadable = Counter("kvrouter_prefix_unreadable_prompts", "Prompts the router could not "
                                  "tokenize (routed on load alone)", ["model"], registry=registry)
        self.index_up = Gauge("kvrouter_index_up", "1 when the prefix index is reachable", registry=registry)
        self.index_errors = Counter("kvrouter_index_errors", "Index operations that failed or were dropped",
                                    ["op"], registry=registry)
        self.index_up.set(1)
        self._children: dict[tuple[int, str], Any] = {}

    def child(self, metric: Any, model: str) -> Any:
        key = (id(metric), model)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(model)
        return c

    def availability(self, up: bool) -> None:
        self.index_up.set(1 if up else 0)

    def error(self, op: str) -> None:
        self.index_errors.labels(op).inc()


class _Model:
    __slots__ = ("name", "block_size", "tok", "backend", "seed")

    def __init__(self, name: str, block_size: int, tok: ModelTokenizer | None,
                 backend: BackendTokenizer | None) -> None:
        self.name = name
        self.block_size = block_size
        self.tok = tok
        self.backend = backend
        self.seed = seed_hash(name)


def build_index(config: Config, events: IndexEvents | None = None) -> MemoryIndex | RedisIndex:
    """The index named by ``index.backend``, with per-replica capacities from the config."""
    ic = config.index
    caps = {r.id: r.capacity_blocks for r in config.replicas if r.capacity_blocks}
    if ic.backend == "redis" and ic.cluster:
        from router.index.cluster import RedisClusterIndex

        assert ic.url
        return RedisClusterIndex(ic.url, namespace=ic.namespace, ttl_s=ic.ttl_s,
                                 default_capacity=ic.capacity_blocks, capacities=caps, events=events)
    if ic.backend == "redis":
        assert ic.url
        return RedisIndex(ic.url, namespace=ic.namespace, ttl_s=ic.ttl_s, default_capacity=ic.capacity_blocks,
                          capacities=caps, events=events)
    return MemoryIndex(ic.capacity_blocks, caps, ttl_s=ic.ttl_s)


class PrefixService:
    """Tokenization, hashing and the index for the proxy (see module docstring)."""

    def __init__(self, config: Config, registry: CollectorRegistry, index: Any = None) -> None:
        self.config = config
        self.metrics = PrefixMetrics(registry)
        self.index = index if index is not None else build_index(config, self.metrics)
        self._registry = registry
        self._own_index = index is None
        self.events: Any = None
        if index is None:  # replicas with kv_events: exact tracking (docs/kv-events.md)
            from router.exact_index import attach_events
            self.index, self.events = attach_events(config, self.index, registry)
        self._models: dict[str, _Model] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._states: Callable[[], Iterable[ReplicaState]] | None = None
        self._caps: dict[str, int] = {}
        self._cap_task: asyncio.Task[None] | None = None
        self.capacity_interval_s = 2.0

    # -- lifecycle --------------------------------------------------------------------
    def bind_states(self, states: Callable[[], Iterable[ReplicaState]]) -> None:
        """Follow the pool's replica states: a replica's ``capacity_blocks`` (from the config,
        or scraped from the engine's ``vllm:cache_config_info``) becomes its index bound."""
        self._states = states

    def sync_capacities(self) -> None:
        if self._states is None:
            return
        for st in self._states():
            cap = st.capacity_blocks
            if cap and cap > 0 and self._caps.get(st.id) != cap:
                self._caps[st.id] = cap
                self.index.set_capacity(st.id, cap)

    async def _follow_capacities(self) -> None:
        while True:
            try:
                self.sync_capacities()
            except Exception as exc:  # never let a bad state stop the loop
                log.debug("prefix: capacity sync failed: %s", exc)
            await asyncio.sleep(self.capacity_interval_s)

    async def start(self) -> None:
        for name in self.config.model_names():
            self.model(name)  # load tokenizers now: a bad path fails at startup, not per request
        await self.index.start()
        if self._states is not None and self._cap_task is None:
            self._cap_task = asyncio.get_running_loop().create_task(self._follow_capacities())

    async def close(self) -> None:
        await stop_task(self._cap_task)
        self._cap_task = None
        for t in list(self._tasks):
            await asyncio.gather(t, return_exceptions=True)
        for m in self._models.values():
            if m.backend is not None:
                await m.backend.close()
        await self.index.close()

    def model(self, name: str) -> _Model:
        m = self._models.get(name)
        if m is None:
            mc = self.config.model(name)
            tok = load_tokenizer(mc.tokenizer)
            backend = None
            if tok is None:
                reps = [r for r in self.config.replicas if name in r.models]
                backend = BackendTokenizer([r.url for r in reps], reps[0].api_key if reps else None)
            m = self._models[name] = _Model(name, mc.block_size, tok, backend)
        return m

    # -- request path -----------------------------------------------------------------
    async def annotate(self, path: str, body: Mapping[str, Any], req: RoutingRequest) -> None:
        try:
            m = self.model(req.model)
            req.block_size = m.block_size
            chat = path.startswith("/v1/chat/completions")
            if not chat and not path.startswith("/v1/completions"):
                return
            salt = body.get("cache_salt")
            seed = seed_hash(req.model, None, salt) if isinstance(salt, str) and salt else m.seed
            res = await self._blocks(m, chat, body, seed)
            if res is None:
                self.metrics.child(self.metrics.unreadable, req.model).inc()
                return
            req.num_tokens, req.hashes = res
        except Exception as exc:  # client content must never fail the request
            log.debug("prefix: cannot read prompt of %s: %s", req.request_id, exc)
            self.metrics.child(self.metrics.unreadable, req.model).inc()

    async def _blocks(self, m: _Model, chat: bool, body: Mapping[str, Any],
                      seed: int) -> tuple[int, list[int]] | None:
        add_gen = body.get("add_generation_prompt", True)
        add_gen = add_gen if isinstance(add_gen, bool) else True
        if m.tok is not None:
            if chat:
                extra = body.get("chat_template_kwargs")
                extra = dict(extra) if isinstance(extra, Mapping) else {}
                if isinstance(body.get("tools"), list):
                    extra.setdefault("tools", body["tools"])
                return m.tok.chat_blocks(body.get("messages"), add_gen, extra, m.block_size, seed)
            return m.tok.prompt_blocks(body.get("prompt"), m.block_size, seed)
        assert m.backend is not None
        ids: list[int] | None = None
        if chat:
            msgs = body.get("messages")
            if isinstance(msgs, list) and msgs:
                ids = await m.backend.tokens({"model": m.name, "messages": msgs, "add_generation_prompt": add_gen})
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                ids = prompt
            elif isinstance(prompt, str) and prompt:
                ids = await m.backend.tokens({"model": m.name, "prompt": prompt})
        return (len(ids), block_hashes(ids, m.block_size, seed)) if ids else None

    async def lookup(self, req: RoutingRequest) -> dict[str, int]:
        if not req.hashes:
            return {}
        try:
            return await self.index.lookup(req.model, req.hashes)
        except Exception as exc:  # the index adapters do not raise; belt and braces
            self.metrics.error("lookup")
            log.debug("prefix: lookup failed: %s", exc)
            return {}

    def record(self, req: RoutingRequest, replica: str) -> None:
        if req.hashes:
            self.index.record_nowait(req.model, req.hashes, replica)

    def observe(self, req: RoutingRequest, decision: Decision, cached_tokens: int | None) -> None:
        if not req.num_tokens:
            return
        mt = self.metrics
        model = req.model
        predicted = min(decision.matched_tokens, req.num_tokens)
        mt.child(mt.prompt_tokens, model).inc(req.num_tokens)
        mt.child(mt.predicted, model).inc(predicted)
        mt.child(mt.predicted_hist, model).observe(predicted)
        if cached_tokens is not None:
            mt.child(mt.observed, model).inc()
            mt.child(mt.measured, model).inc(cached_tokens)
            mt.child(mt.measured_hist, model).observe(cached_tokens)

    def replica_removed(self, replica: str) -> None:
        left = self._states is not None and all(st.id != replica for st in self._states())
        forget = getattr(self.index, "remove_replica", None) if left else None
        try:  # left the pool: stop following its events too (they would rebuild its entries)
            task = asyncio.get_running_loop().create_task(
                forget(replica) if forget is not None else self.index.clear(replica))
        except RuntimeError:
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def replica_added(self, rc: ReplicaConfig) -> None:
        """A replica joined through the admin API: follow its KV events if it has ``kv_events``."""
        if rc.kv_events is None:
            return
        from router.exact_index import ExactAwareIndex, event_sources

        await asyncio.gather(*list(self._tasks), return_exceptions=True)  # a removal of the same id first
        cfg = dataclasses.replace(self.config, replicas=(rc,))
        if isinstance(self.index, ExactAwareIndex):
            await self.index.follow(event_sources(cfg)[0])
        else:
            await self.apply_events(cfg)

    async def apply_events(self, config: Config) -> None:
        """Config reload: follow the KV events of the replicas whose ``kv_events`` appeared
        or changed, stop following those whose ``kv_events`` (or replica) went away."""
        from router.exact_index import ExactAwareIndex, attach_events, event_sources

        await asyncio.gather(*list(self._tasks), return_exceptions=True)  # removals first
        if isinstance(self.index, ExactAwareIndex):
            added, dropped = await self.index.sync_sources(event_sources(config))
            if added or dropped:
                log.info("kv events: now following %s, stopped %s", added, dropped)
        elif self._own_index and event_sources(config):
            self.index, self.events = attach_events(config, self.index, self._registry)
            for rid, cap in self._caps.items():
                self.index.set_capacity(rid, cap)
            await self.index.start()
            log.info("kv events: now following %s", self.events.replicas())


def build_prefix_service(config: Config, registry: CollectorRegistry) -> PrefixService:
    """The router's prefix service (called by ``router.server`` when the policy needs it)."""
    return PrefixService(config, registry)
