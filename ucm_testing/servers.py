"""Private redis-server instances and a small Redis Cluster on loopback.

Each server gets a free port, a temporary directory, no persistence, and is
stopped by its PID.  Used by the fixtures in tests/conftest.py, by the fault
tests that stop and restart a server mid-run, and by the benchmarks.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 45000)
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} did not start in {timeout} s")


class RedisServer:
    """One redis-server process on 127.0.0.1."""

    def __init__(self, port: int | None = None, *, password: str | None = None,
                 extra: list[str] | None = None, directory: str | None = None,
                 unixsocket: bool = False) -> None:
        self.port = port or free_port()
        self.password = password
        self.extra = list(extra or [])
        self.dir = directory or tempfile.mkdtemp(prefix="ucm-redis-")
        self.unixsocket = os.path.join(self.dir, "redis.sock") if unixsocket else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self.dir,
                "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.unixsocket:
            args += ["--unixsocket", self.unixsocket, "--unixsocketperm", "700"]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """A Redis Cluster of ``num_masters`` masters (no replicas) on loopback."""

    def __init__(self, num_masters: int = 3, *, password: str | None = None) -> None:
        self.password = password
        auth = ["--masterauth", password] if password else []
        self.servers = [
            RedisServer(password=password,
                        extra=["--cluster-enabled", "yes",
                               "--cluster-config-file", "nodes.conf",
                               "--cluster-node-timeout", "2000", *auth])
            for _ in range(num_masters)
        ]

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return "redis-cluster://" + auth + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def _cli(self, *args: str) -> list[str]:
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        return [REDIS_CLI, *auth, *args]

    def start(self) -> "RedisCluster":
        for server in self.servers:
            server.start()
        nodes = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run(self._cli("--cluster", "create", *nodes, "--cluster-replicas", "0",
                                 "--cluster-yes"), check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=60)
        # Every node, not just one: a node that has not yet seen the others'
        # slots answers CLUSTERDOWN for a moment after the create.
        deadline = time.monotonic() + 30
        pending = list(self.servers)
        while pending and time.monotonic() < deadline:
            out = subprocess.run(self._cli("-p", str(pending[0].port), "cluster", "info"),
                                 capture_output=True, text=True, timeout=10).stdout
            if "cluster_state:ok" in out:
                pending.pop(0)
            else:
                time.sleep(0.1)
        if pending:
            raise RuntimeError("redis cluster did not reach cluster_state:ok")
        return self

    def cleanup(self) -> None:
        for server in self.servers:
            server.cleanup()
