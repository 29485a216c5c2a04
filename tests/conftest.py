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


@pytest.fixture(scope="session")
def thirdparty_entry_point(tmp_path_factory):
    """Declare ``memdict://`` (tests/thirdparty_store.py) under the
    ``ucm_connector.stores`` entry-point group, the way an installed
    distribution would: a dist-info folder on sys.path."""
    site = tmp_path_factory.mktemp("site")
    info = site / "ucm_test_memdict-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ucm-test-memdict\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[ucm_connector.stores]\nmemdict = thirdparty_store:MemDictStore\n")
    sys.path.insert(0, str(site))
    yield "memdict"
    sys.path.remove(str(site))


@pytest.fixture
def unique_name():
    return "t" + uuid.uuid4().hex[:12]
