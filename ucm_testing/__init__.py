"""What the tests and the benchmarks share to set up real parts: private
``redis-server`` instances and a Redis Cluster on loopback (``servers``), a
bandwidth-limiting TCP proxy in front of one (``throttle``), waiting for a
store's background writes to settle (``stores``), and a harness that steps
vLLM's real scheduler with a fake model over real stores (``kvharness``,
imported by its module name: it needs vLLM), and the dtype the test engines
compute in on this CPU (``dtypes``).

Installed with the distribution so that benchmarks import it without
editing ``sys.path``; the product packages (``ucm_connector``,
``store_backends``, ``patches``) never import it.
"""

from .servers import REDIS_CLI, REDIS_SERVER, RedisCluster, RedisServer, free_port
from .stores import count_blocks, wait_quiet
from .throttle import ThrottleProxy

__all__ = ["REDIS_CLI", "REDIS_SERVER", "RedisCluster", "RedisServer", "ThrottleProxy", "count_blocks",
           "free_port", "wait_quiet"]
