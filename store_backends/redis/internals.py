"""Every use of redis-py's internals by the Redis stores, in one place,
checked against the installed redis-py before a store is opened.

redis-py owns connecting, AUTH, SELECT, TLS, the pools and the cluster's
slot map; the stores write commands to the socket and read the replies
themselves (``resp.py``).  For that they lean on things redis-py does not
document as its API:

* a connection's socket is ``conn._sock`` (None until connected);
* ``connect()`` reads ``socket_timeout`` and ``socket_connect_timeout``
  when it runs (so the cluster store's connections connect within what is
  left of a call's deadline);
* a pool's ``connection_class`` and ``connection_kwargs`` (the cluster
  store makes pools of its own, connected like redis-py's for each node);
* ``ConnectionPool.get_connection`` wants a command name before redis-py
  5.3 and warns about one after;
* a cluster's ``nodes_manager.slots_cache`` (slot -> nodes, primary first)
  and ``nodes_manager.initialize()`` (reload it).

``check_library``, ``check_pool`` and ``check_cluster`` run when a store
opens, as ``patches/`` checks vLLM before patching it: a redis-py older
than the oldest supported, or one that no longer has any of the above, is
then a ``StoreOpenError`` naming its version and everything missing, never
an ``AttributeError`` in the middle of a call.  A redis-py newer than the last one tested is used
when everything above is still there: what matters is their shape, and
that is what is checked.

No other module of the package touches these names.  This module must not
send or read commands (``resp.py``) nor decide what a failure means
(``errors.py``).
"""

from __future__ import annotations

import inspect
import re
import socket
import threading

import redis as redis_py

from ..base import StoreOpenError
from .resp import time_left

MIN_VERSION = (5, 0)
LAST_TESTED = "8.1"
KNOWN_GOOD = "redis>=5.0,<8.2"
_CONNECTION_ATTRS = ("_sock", "socket_timeout", "socket_connect_timeout")


def redis_py_version() -> str:
    return str(getattr(redis_py, "__version__", "unknown"))


def _version_tuple(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


# -- the checks ------------------------------------------------------------------

def library_problems() -> list[str]:
    """What the installed redis-py lacks, whatever the server."""
    problems = []
    found = _version_tuple(redis_py_version())
    if found is not None and found < MIN_VERSION:
        problems.append(f"it is older than {MIN_VERSION[0]}.{MIN_VERSION[1]}")
    if not callable(getattr(redis_py.ConnectionPool, "get_connection", None)):
        problems.append("ConnectionPool has no get_connection()")
    connection = getattr(redis_py.connection, "AbstractConnection", redis_py.Connection)
    if not callable(getattr(connection, "connect", None)):
        problems.append("its connections have no connect()")
    manager = getattr(redis_py.cluster, "NodesManager", None)
    if manager is None:
        problems.append("redis.cluster has no NodesManager (the keeper of the slot map)")
    elif not callable(getattr(manager, "initialize", None)):
        problems.append("NodesManager has no initialize() to reload the slot map")
    return problems


def connection_problems(connection_class: type, connection_kwargs: dict) -> list[str]:
    """What a connection of this class and these settings lacks; looked at
    unconnected (making one does no I/O)."""
    try:
        conn = connection_class(**connection_kwargs)
    except Exception as exc:  # noqa: BLE001 - reported, with the rest, as a redis-py that changed
        return [f"{connection_class.__name__}(...) fails with the pool's own settings ({exc})"]
    missing = [name for name in _CONNECTION_ATTRS if not hasattr(conn, name)]
    if not callable(getattr(conn, "connect", None)):
        missing.append("connect()")
    return [f"{connection_class.__name__} has no {name}" for name in missing]


def pool_problems(pool: object) -> list[str]:
    missing = [name for name in ("connection_class", "connection_kwargs") if not hasattr(pool, name)]
    if missing:
        return [f"{type(pool).__name__} has no {name}" for name in missing]
    return connection_problems(pool.connection_class, pool.connection_kwargs)  # type: ignore[attr-defined]


def cluster_problems(cluster: object) -> list[str]:
    manager = getattr(cluster, "nodes_manager", None)
    if manager is None:
        return [f"{type(cluster).__name__} has no nodes_manager"]
    problems = []
    if not callable(getattr(getattr(manager, "slots_cache", None), "items", None)):
        problems.append(f"{type(manager).__name__} has no slots_cache mapping")
    if not callable(getattr(manager, "initialize", None)):
        problems.append(f"{type(manager).__name__} has no initialize() to reload the slot map")
    try:
        primaries = cluster.get_primaries()  # type: ignore[attr-defined]
        if primaries:
            client = cluster.get_redis_connection(primaries[0])  # type: ignore[attr-defined]
            problems += pool_problems(client.connection_pool)
    except AttributeError as exc:
        problems.append(f"{type(cluster).__name__}: {exc}")
    return problems


def require(masked_url: str, problems: list[str]) -> None:
    """``StoreOpenError`` naming the redis-py version and every problem."""
    if problems:
        raise StoreOpenError(
            f"store '{masked_url}': the Redis store cannot work with redis-py {redis_py_version()}: "
            + "; ".join(problems)
            + f"; install a supported redis-py: pip install '{KNOWN_GOOD}' (last tested: {LAST_TESTED})")


def check_library(masked_url: str) -> None:
    """Before anything is built: the installed redis-py as a whole."""
    require(masked_url, library_problems())


def check_pool(masked_url: str, pool: redis_py.ConnectionPool) -> None:
    """A single server's pool, before it connects (redis-py as a whole too)."""
    require(masked_url, library_problems() + pool_problems(pool))


def check_cluster(masked_url: str, cluster: redis_py.RedisCluster) -> None:
    """A cluster client once it has loaded the slot map."""
    require(masked_url, cluster_problems(cluster))


# -- connections and their sockets -------------------------------------------------

def _pool_wants_command() -> bool:
    try:
        parameters = inspect.signature(redis_py.ConnectionPool.get_connection).parameters
    except (AttributeError, TypeError, ValueError):
        return False  # library_problems() says what is wrong, at open
    parameter = parameters.get("command_name")
    return parameter is not None and parameter.default is inspect.Parameter.empty


_POOL_WANTS_COMMAND = _pool_wants_command()


def get_connection(pool: redis_py.ConnectionPool) -> redis_py.Connection:
    # redis-py before 5.3 needs a command name here, later ones warn about it.
    if _POOL_WANTS_COMMAND:
        return pool.get_connection("GET")
    return pool.get_connection()


def socket_of(conn: redis_py.Connection) -> socket.socket:
    """The connection's socket, connecting first if it has none."""
    sock = conn._sock
    if sock is None:
        conn.connect()
        sock = conn._sock
    return sock


def give_back_timeout(conn: redis_py.Connection) -> None:
    """Put the connection's own socket timeout back after an exchange that
    set per-call ones: redis-py's own commands share single-server pools
    and read with the socket's timeout."""
    sock = conn._sock
    if sock is not None:
        sock.settimeout(conn.socket_timeout)


# -- connecting within a call's deadline ------------------------------------------

# The deadline of the call running on this thread, for connections that a
# call makes (redis-py makes them inside ConnectionPool.get_connection).
_call = threading.local()


def set_call_deadline(deadline: float | None) -> None:
    """The deadline of the call now running on this thread (None: none)."""
    _call.deadline = deadline


class _ConnectWithinDeadline:
    """Mixed into the connection class of the cluster store's own pools: a
    connection made or remade during a call gets only what is left of the
    call's time for the TCP connect and redis-py's handshake, which would
    otherwise take up to ``timeout`` each on a stopped node."""

    def connect(self, *args, **kwargs):
        deadline = getattr(_call, "deadline", None)
        if deadline is None:
            return super().connect(*args, **kwargs)
        left = time_left(deadline)
        timeout, connect_timeout = self.socket_timeout, self.socket_connect_timeout
        self.socket_timeout = left if timeout is None else min(timeout, left)
        self.socket_connect_timeout = left if connect_timeout is None else min(connect_timeout, left)
        try:
            return super().connect(*args, **kwargs)
        finally:
            self.socket_timeout, self.socket_connect_timeout = timeout, connect_timeout


_within_deadline_classes: dict[type, type] = {}


def _within_deadline(connection_class: type) -> type:
    """``connection_class`` (plain, TLS...) with ``_ConnectWithinDeadline``."""
    if issubclass(connection_class, _ConnectWithinDeadline):
        return connection_class
    cls = _within_deadline_classes.get(connection_class)
    if cls is None:
        cls = type(f"Deadline{connection_class.__name__}", (_ConnectWithinDeadline, connection_class), {})
        _within_deadline_classes[connection_class] = cls
    return cls


def pool_like(pool: redis_py.ConnectionPool) -> redis_py.ConnectionPool:
    """A new pool whose connections are made like ``pool``'s, and connect
    within the deadline of the call that makes them."""
    return redis_py.ConnectionPool(connection_class=_within_deadline(pool.connection_class),
                                   **pool.connection_kwargs)


# -- the cluster's slot map ---------------------------------------------------------

def slot_primaries(cluster: redis_py.RedisCluster) -> list[tuple[int, object]]:
    """``(slot, primary node)`` for every slot redis-py's map assigns."""
    return [(slot, nodes[0]) for slot, nodes in list(cluster.nodes_manager.slots_cache.items()) if nodes]


def reload_slot_map(cluster: redis_py.RedisCluster) -> None:
    """Ask the nodes for the slot map again (blocking: node after node)."""
    cluster.nodes_manager.initialize()
