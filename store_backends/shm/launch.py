"""Starting the index server of an ``shm://NAME`` store from a client.

Owns ``ServerSettings`` (what a client starts a server with) and
``start_server``: under NAME's start lock, so that processes racing to start
one end up with one, it runs ``python -m store_backends.shm_server serve
--detach`` and waits until the server is ready or the deadline passes.  Must
not decide whether a server may be started (the connection's guard: an
inspecting client starts nothing), talk to a running server, or map its
segments.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

from ..base import StoreOpenError, StoreUnavailableError
from .paths import Paths, UnsafeRuntimeDir, lock_until
from .protocol import EXIT_ALREADY_RUNNING

_START_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """The figures a client starts a server with.  A running server keeps
    its own; ``prefault`` also says whether clients map up front."""

    name: str
    capacity_nbytes: int
    chunk_nbytes: int
    idle_timeout_s: float | None
    lease_timeout_s: float
    prefault: bool
    cpus: tuple[int, ...] | None = None

    def serve_command(self, paths: Paths) -> list[str]:
        """The command line that starts this server detached."""
        cmd = [sys.executable, "-m", "store_backends.shm_server", "serve",
               "--capacity", str(self.capacity_nbytes), "--chunk", str(self.chunk_nbytes),
               "--lease-timeout", repr(float(self.lease_timeout_s)),
               "--runtime-dir", paths.rundir, "--detach"]
        if self.idle_timeout_s is not None:
            cmd += ["--idle-timeout", repr(float(self.idle_timeout_s))]
        if not self.prefault:
            cmd.append("--no-prefault")
        if self.cpus:
            cmd += ["--cpus", ",".join(map(str, self.cpus))]
        # After "--": a NAME may start with '-' and must not read as an option.
        return cmd + ["--", self.name]


def start_server(settings: ServerSettings, paths: Paths, url: str, deadline: float | None) -> None:
    """Start a detached server and wait until it is ready, or until the
    operation's ``deadline``; when opening (``None``), as long as reserving
    the memory may take.  A server still starting when the deadline passes
    goes on starting, and a later call finds it.  ``url`` (masked) names the
    store in errors."""
    try:
        paths.ensure_rundir()
    except UnsafeRuntimeDir as exc:
        raise StoreOpenError(f"store '{url}': {exc}") from None
    if deadline is None:
        # Reserving the memory takes about a second per GiB on a slow host.
        deadline = time.monotonic() + _START_TIMEOUT_S + 5.0 * settings.capacity_nbytes / (1 << 30)
    fd = os.open(paths.start_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not lock_until(fd, deadline):
            raise StoreUnavailableError(
                f"store '{url}' unavailable: another process is starting the shm server "
                f"and has not finished in time ({paths.start_lock})")
        if paths.server_running():
            return  # started by whoever held the lock before us
        env = dict(os.environ)
        # The directory holding the store_backends package.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        wait_s = max(0.001, deadline - time.monotonic())
        try:
            done = subprocess.run(settings.serve_command(paths), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                  env=env, cwd="/", timeout=wait_s)
        except subprocess.TimeoutExpired as exc:
            raise StoreUnavailableError(f"store '{url}' unavailable: the shm server did not get "
                                        f"ready within {wait_s:.1f}s; see {paths.log}") from exc
        if done.returncode not in (0, EXIT_ALREADY_RUNNING):
            detail = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
            raise StoreOpenError(f"store '{url}': could not start the shm server: {detail}")
    finally:
        os.close(fd)  # releases the lock
