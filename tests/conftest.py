"""Shared fixtures: private Redis servers, a Redis Cluster, temp stores."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from servers import RedisCluster, RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def redis_cluster():
    cluster = RedisCluster(3).start()
    yield cluster
    cluster.cleanup()


@pytest.fixture
def unique_name():
    return "t" + uuid.uuid4().hex[:12]
