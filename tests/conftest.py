"""Shared fixtures: private Redis servers, a Redis Cluster, temp stores."""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from servers import RedisCluster, RedisServer  # noqa: E402

# Shared-memory store servers of this test run keep their sockets and lock
# files in a directory of their own (inherited by child processes), which the
# session's end empties after stopping any server a failed test left behind.
_SHM_RUNTIME_DIR = tempfile.mkdtemp(prefix="ucm-shm-test-")
os.environ["UCM_SHM_RUNTIME_DIR"] = _SHM_RUNTIME_DIR
# vLLM names its engines' ZeroMQ sockets in VLLM_RPC_BASE_PATH (the system's
# temporary directory by default) and leaves several behind per engine, even
# after a clean shutdown: the test run's engines keep theirs in a directory
# the session's end removes.
_VLLM_RPC_DIR = tempfile.mkdtemp(prefix="ucm-vllm-rpc-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _VLLM_RPC_DIR)


def pytest_report_header(config):
    """Which vLLM the tests import (``make test-vllm-next`` puts another
    release's Python first), read from its files: importing vLLM here would
    cost every run seconds."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return "vLLM: not installed"
    path = os.path.join(os.path.dirname(spec.origin), "_version.py")
    try:
        with open(path, encoding="utf-8") as f:
            found = re.search(r"""^__version__ = version = ['"]([^'"]+)""", f.read(), re.M)
    except OSError:
        found = None
    return f"vLLM {found.group(1) if found else '(version unknown)'} from {os.path.dirname(spec.origin)}"


@pytest.fixture(scope="session", autouse=True)
def _stop_leftover_shm_servers():
    yield
    from store_backends import stop_server

    for pid_file in glob.glob(os.path.join(_SHM_RUNTIME_DIR, "*.pid")):
        name = os.path.basename(pid_file)[: -len(".pid")]
        try:
            stop_server(name, _SHM_RUNTIME_DIR)
        except Exception as exc:
            print(f"could not stop the shm server {name!r}: {exc}", file=sys.stderr)
    shutil.rmtree(_SHM_RUNTIME_DIR, ignore_errors=True)
    shutil.rmtree(_VLLM_RPC_DIR, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _record_triton_variants():
    """``make test-kernels``: note each Triton kernel variant launched, for
    ``ucm_testing.triton_variants`` to compile for a GPU afterwards."""
    path = os.environ.get("UCM_TRITON_VARIANTS")
    if not path:
        yield
        return
    from ucm_testing.triton_variants import record

    with record(path):
        yield


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
