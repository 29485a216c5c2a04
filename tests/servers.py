"""The tests' name for ``ucm_testing.servers``: private redis-server
instances and a Redis Cluster on loopback."""

from ucm_testing.servers import REDIS_CLI, REDIS_SERVER, RedisCluster, RedisServer, free_port

__all__ = ["REDIS_CLI", "REDIS_SERVER", "RedisCluster", "RedisServer", "free_port"]
