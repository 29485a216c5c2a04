"""The Redis Cluster store: ``redis-cluster://`` URLs.

This module owns opening a cluster from its seed nodes, the slot map
(slot -> the pool of the primary that owns it; reloaded in the background,
never inside a call) and the split of a batch into one exchange per
primary.  redis-py keeps the cluster's topology and serves its own
commands (slot map, stats, SCAN); the store's exchanges go through pools
of its own, whose connections connect within the call's deadline.  It must
not hash keys itself (``slots.py``) nor reach into redis-py's cluster
objects but through ``internals.py``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import numpy as np
import redis as redis_py
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..base import OpenMode, StoreOpenError, StoreStats, StoreUnavailableError
from ..urls import mask_password, parse_bool, query_options, split_store_url
from . import internals, resp
from .errors import CLUSTER_OPEN_ERRORS, cluster_open_message
from .options import (COMMON_OPTIONS, DEFAULT_NAMESPACE, DEFAULT_TIMEOUT_S, SSL_OPTIONS, cluster_seeds,
                      common_options, ssl_kwargs)
from .slots import NUM_SLOTS, slots_of
from .store import Group, RedisStoreBase


@dataclasses.dataclass(frozen=True)
class _SlotMap:
    """Which pool serves each slot: ``pools[node_of_slot[slot]]`` (-1: no
    node).  Replaced whole, never changed, so a call that took it sees one
    consistent map while a reload runs."""

    pools: list[redis_py.ConnectionPool]
    node_of_slot: np.ndarray


class _Reload(threading.Event):
    """A background reload of the slot map: set when it ends; ``ok`` when it
    brought a new map."""

    ok = False


class RedisClusterStore(RedisStoreBase):
    """A Redis Cluster: each key goes to the primary that owns its slot;
    a batch becomes one pipelined exchange per primary, all primaries at
    once.

    Exchanges go through pools of the store's own, one per primary, whose
    connections connect within the call's deadline; redis-py's pools serve
    its own commands (slot map, stats, SCAN).  The slot map is reloaded by a
    background thread, never inside a call: a reload asks nodes one after
    the other and can meet a stopped one first."""

    KIND = "redis-cluster"
    COUNTS_SCOPE = "every key and the used_memory of every primary, all namespaces and overhead included"

    def __init__(self, url: str, cluster: redis_py.RedisCluster, *, namespace: str = DEFAULT_NAMESPACE,
                 ttl_s: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(url, namespace, ttl_s, timeout_s)
        self._cluster = cluster
        self._map_lock = threading.Lock()
        self._stale = False
        self._reloading: _Reload | None = None
        self._pools: dict[str, redis_py.ConnectionPool] = {}
        self._map = self._load_slots()

    @classmethod
    def from_url(cls, url: str, mode: OpenMode | str = OpenMode.SERVE) -> "RedisClusterStore":
        """Open the cluster once a seed node has given its slot map.  Both
        modes open exactly that (see ``RedisStore.from_url``)."""
        OpenMode(mode)
        masked = mask_password(url)
        parts = split_store_url(url, ("redis-cluster",))
        path = parts.path
        if path.strip("/") not in ("", "0"):
            raise StoreOpenError(
                f"store '{masked}': a Redis Cluster has only database 0; drop '/{path.strip('/')}' from the URL")
        allowed = (COMMON_OPTIONS - {"max_connections"}) | SSL_OPTIONS | {"ssl"}
        options = query_options(url, allowed)
        common = common_options(url, options)
        seeds = cluster_seeds(url, parts.netloc)
        nodes = [redis_py.cluster.ClusterNode(host, port) for host, port in seeds.nodes]
        kwargs: dict[str, object] = dict(
            username=seeds.username, password=seeds.password,
            socket_timeout=common.timeout_s, socket_connect_timeout=common.timeout_s,
            retry=Retry(NoBackoff(), 0), protocol=resp.PROTOCOL,
        )
        if "ssl" in options and parse_bool(options["ssl"], url=url, name="ssl"):
            kwargs.update(ssl=True, **ssl_kwargs(url, options))
        elif set(options) & SSL_OPTIONS:
            raise StoreOpenError(f"store '{masked}': ssl_* options need ssl=true")
        internals.check_library(masked)
        try:
            cluster = redis_py.RedisCluster(startup_nodes=nodes, **kwargs)
        except CLUSTER_OPEN_ERRORS as exc:
            raise StoreOpenError(cluster_open_message(masked, seeds.password, exc)) from None
        try:
            internals.check_cluster(masked, cluster)
        except StoreOpenError:
            cluster.close()
            raise
        return cls(url, cluster, namespace=common.namespace, ttl_s=common.ttl_s, timeout_s=common.timeout_s)

    def _own_pool(self, node: redis_py.cluster.ClusterNode) -> redis_py.ConnectionPool:
        pool = self._pools.get(node.name)
        if pool is None:
            pool = internals.pool_like(self._cluster.get_redis_connection(node).connection_pool)
            self._pools[node.name] = pool
        return pool

    def _load_slots(self) -> _SlotMap:
        """Slot -> the pool of the primary that owns it, from redis-py's map."""
        pools: list[redis_py.ConnectionPool] = []
        index: dict[str, int] = {}
        node_of_slot = np.full(NUM_SLOTS, -1, dtype=np.int32)
        for slot, primary in internals.slot_primaries(self._cluster):
            n = index.get(primary.name)
            if n is None:
                n = index[primary.name] = len(pools)
                pools.append(self._own_pool(primary))
            node_of_slot[slot] = n
        return _SlotMap(pools, node_of_slot)

    def _reload_in_background(self) -> _Reload:
        """Start reloading the slot map unless a reload is running."""
        with self._map_lock:
            done = self._reloading
            if done is None:
                done = self._reloading = _Reload()
                threading.Thread(target=self._reload, args=(done,), name="ucm-cluster-slot-map",
                                 daemon=True).start()
        return done

    def _reload(self, done: _Reload) -> None:
        # Cleared first: a connection error seen while this runs marks the
        # map stale again, and is not lost.
        self._stale = False
        try:
            internals.reload_slot_map(self._cluster)
            if not self._closed:
                self._map = self._load_slots()
                done.ok = True
        except Exception:  # noqa: BLE001 - whatever failed, keep the old map; the next call asks again
            self._stale = True
        finally:
            with self._map_lock:
                self._reloading = None
            done.set()

    def _after_redirect(self, deadline: float) -> bool:
        self._stale = True
        reload = self._reload_in_background()
        return reload.wait(max(0.0, deadline - time.monotonic())) and reload.ok

    def _on_connection_error(self) -> None:
        # A primary may have failed over to a replica: reload the map.
        self._stale = True
        self._reload_in_background()

    def _groups(self, keys: Sequence[bytes], positions: list[int] | None) -> list[Group]:
        if self._stale:
            self._reload_in_background()
        slot_map = self._map
        picked = keys if positions is None else [keys[i] for i in positions]
        nodes = slot_map.node_of_slot[slots_of(self._prefix, picked)]
        if (nodes < 0).any():
            self._stale = True
            self._reload_in_background()
            raise StoreUnavailableError(
                f"store '{self.url}' unavailable: no cluster node serves the slot of a key "
                f"(cluster resharding or down)")
        served = np.unique(nodes).tolist()
        if positions is None:
            if len(served) == 1:
                return [(slot_map.pools[served[0]], None)]
            return [(slot_map.pools[n], np.flatnonzero(nodes == n).tolist()) for n in served]
        order = np.asarray(positions)
        return [(slot_map.pools[n], order[nodes == n].tolist()) for n in served]

    def stats(self) -> StoreStats:
        primaries = self._cluster.get_primaries()
        return self._stats_from([self._cluster.get_redis_connection(node) for node in primaries])

    def _scan_clients(self) -> list[redis_py.Redis]:
        return [self._cluster.get_redis_connection(node) for node in self._cluster.get_primaries()]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            reloading = self._reloading
            if reloading is not None:
                reloading.wait(self._timeout_s)
            for pool in list(self._pools.values()):  # a reload still running may add one
                pool.disconnect()
            self._cluster.close()
