"""Redis and Redis Cluster stores: each block is one Redis string.

URLs::

    redis://[user:password@]host[:port][/db][?options]
    rediss://[user:password@]host[:port][/db][?options]     (TLS)
    unix://[user:password@]/path/to/redis.sock[?db=N&options]
    redis-cluster://[user:password@]host:port[,host:port...][?options]

Options (query string; an unknown option is an error that names it):

``namespace`` (default ``ucm``)
    Every Redis key is ``<namespace>:<key bytes>``.  The namespace may use
    only letters, digits and ``_ . -``, so no namespace is a prefix of
    another's keys and nothing a key contains reaches outside it.
``ttl`` (default: none)
    Expiry of each block, a duration (``90``, ``10m``, ``2h``); a put of an
    existing block renews it.
``timeout`` (default ``2``)
    How long one call may wait in all on a stopped or unreachable server
    before ``StoreUnavailableError``: every send and read of the call, on
    every server it talks to, shares one deadline.  On a cluster that
    includes (re)connecting; the slot map is reloaded in the background,
    never inside a call.
``max_connections`` (default: unbounded; single server only)
    Connections in the pool (one per concurrent call); past it a call waits
    up to ``timeout`` for a free one.
``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_check_hostname`` (``rediss://`` and TLS clusters), ``ssl`` (cluster)
    Passed to redis-py's TLS connection.

Capacity is Redis's own business: set ``maxmemory`` on the server and a
``maxmemory-policy``.  ``allkeys-lru`` (or ``allkeys-lfu``) is the policy to
use for a cache: Redis evicts the least-used blocks and ``put`` keeps
succeeding.  With ``noeviction`` a full Redis refuses writes: ``put`` then
returns ``False`` for the blocks it could not store, and reads keep working.
``volatile-*`` policies only evict keys with a TTL, so they fit only with
the ``ttl`` option.  Give the store a database (or a server) of its own:
``stats()`` reports the server's key count and memory, not the namespace's,
since counting one namespace would need a full SCAN.

Why the hot path does not go through redis-py's command layer: a
``get_into`` of 1 MiB blocks through ``MGET`` costs a copy into hiredis's
buffer, a ``bytes`` object, then a copy into the caller's buffer; reading
the RESP reply here lets the payload go from the socket straight into the
caller's buffer (about twice the throughput on loopback).  Likewise
``contains`` on thousands of keys spends most of its time in redis-py's
per-command bookkeeping.  redis-py still owns everything around the bytes:
connecting, AUTH, SELECT, TLS, the connection pools, the cluster's slot map.
A connection whose exchange failed half-way is disconnected, never reused.

The package, one module per concern:

``store.py``      what both stores share: key naming, the pipelined exchange, stats
``single.py``     ``RedisStore``: one server (``redis://``, ``rediss://``, ``unix://``)
``cluster.py``    ``RedisClusterStore``: a Redis Cluster and its slot map
``resp.py``       the RESP2 wire codec: commands out, replies in
``slots.py``      CRC16 cluster slot hashing, vectorised over a batch
``options.py``    the URL options and their checks
``errors.py``     redis-py's and the socket's errors, as messages that say what to do
``internals.py``  every use of redis-py's internals, checked against its version at open
"""

from .cluster import RedisClusterStore, _SlotMap  # noqa: F401 - _SlotMap: tests build stale maps
from .options import DEFAULT_NAMESPACE, DEFAULT_TIMEOUT_S
from .single import RedisStore

__all__ = ["DEFAULT_NAMESPACE", "DEFAULT_TIMEOUT_S", "RedisClusterStore", "RedisStore"]
