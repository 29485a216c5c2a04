"""Engine scripts forked from one process that has imported vLLM already.

Importing vLLM takes 9-13 s of CPU on the test machines, most of what a tiny
engine costs to start, and a test session starts some 45 engines, each in a
process of its own.  The fork server imports vLLM once and forks a child for
each run: to the engine the child is a new process (its own memory, file
descriptors, environment, working directory and process group) that finds
vLLM imported.  Measured on a 2-core AVX2 EPYC: a tiny-llama engine script
took 4.2 s forked, 15.7 s as ``python SCRIPT``, with the same output tokens.

    from ucm_testing.forkserver import run_script

    done = run_script([SCRIPT, *ARGS], env=ENV, cwd=DIR, output=LOG, timeout=600)
    done.rc, done.output, done.timed_out

The child runs SCRIPT as ``__main__`` (``runpy``), as ``python SCRIPT ARGS``
would, with stdout and stderr in the file ``output``.  The server process
has one thread, imports vLLM but never runs torch, and forks from its only
thread, so a child inherits no lock held by another thread.
``UCM_TEST_FORKSERVER=0`` runs each script with ``python`` instead.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the engine scripts import: loaded once, in the server.
PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "ucm_connector.connector")


@dataclass
class Finished:
    rc: int | None          # None: the process died without reporting (a signal)
    output: str             # its stdout and stderr
    timed_out: bool = False
    seconds: float = 0.0


# -- the server (its own process) ------------------------------------------------

def _child(conn: socket.socket, request: dict) -> None:
    """In the forked child: become the script's process, run it, report its
    exit status, then leave the interpreter as the script would (atexit
    handlers such as vLLM's shutdown run).  Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script, *request["argv"][1:]]
    sys.path.insert(0, os.path.dirname(script))
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    rc = 0
    try:
        import runpy

        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        conn.sendall(json.dumps({"rc": rc}).encode() + b"\n")
    except OSError:
        pass
    # The connection closes when this process is gone: the client waits for that.
    raise SystemExit(rc)


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    listener.settimeout(1.0)
    os.rename(path + ".tmp", path)          # the path appears once the server accepts
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)     # children are reaped by the kernel
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        with conn.makefile("rb") as f:
            request = json.loads(f.readline())
        if os.fork() == 0:
            listener.close()
            _child(conn, request)
        conn.close()


# -- the client (the test process) ------------------------------------------------

class ForkServer:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ucm-forks-")
        self.path = os.path.join(self.dir, "server.sock")
        self.log = os.path.join(self.dir, "server.log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> "ForkServer":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "ucm_testing.forkserver", self.path], cwd=ROOT,
                                         env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(self.log, errors="replace") as f:
                    log = f.read()[-4000:]
                self.close()
                raise RuntimeError(f"the fork server did not start:\n{log}")
            time.sleep(0.1)
        return self

    def run(self, argv: list[str], *, env: dict, cwd: str, output: str, timeout: float) -> Finished:
        t0 = time.monotonic()
        deadline = t0 + timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.path)
        sock.sendall(json.dumps({"argv": [str(a) for a in argv], "env": dict(env), "cwd": str(cwd),
                                 "output": str(output)}).encode() + b"\n")
        f = sock.makefile("rb")
        pid, rc, timed_out = None, None, False
        try:
            while True:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    line = f.readline()
                except (socket.timeout, TimeoutError):
                    timed_out = True
                    break
                if not line:
                    break                   # the process is gone
                msg = json.loads(line)
                pid = msg.get("pid", pid)
                if "rc" in msg:
                    rc = msg["rc"]
                    deadline = max(deadline, time.monotonic() + 60)   # room for its shutdown
        finally:
            if timed_out and pid is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            f.close()
            sock.close()
        with open(output, errors="replace") as out:
            text = out.read()
        return Finished(rc=rc, output=text, timed_out=timed_out and rc is None, seconds=time.monotonic() - t0)

    def close(self) -> None:
        import shutil

        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_server: ForkServer | None = None
_lock = threading.Lock()


def _shared() -> ForkServer:
    global _server
    with _lock:
        if _server is None or _server.proc is None or _server.proc.poll() is not None:
            _server = ForkServer().start()
            atexit.register(_server.close)
        return _server


def run_script(argv: list[str], *, env: dict, cwd: str, output: str, timeout: float) -> Finished:
    """Run ``python ARGV`` (a script and its arguments), forked from the shared
    server unless ``UCM_TEST_FORKSERVER=0``; its stdout and stderr go to
    ``output`` and come back in ``Finished.output``."""
    if os.environ.get("UCM_TEST_FORKSERVER", "1") == "0":
        t0 = time.monotonic()
        with open(output, "w") as out:
            proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc, timed_out = proc.wait(timeout=timeout), False
                rc = None if rc < 0 else rc          # killed by a signal, as forked runs report it
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc, timed_out = None, True
        with open(output, errors="replace") as out:
            return Finished(rc=rc, output=out.read(), timed_out=timed_out, seconds=time.monotonic() - t0)
    return _shared().run(argv, env=env, cwd=cwd, output=output, timeout=timeout)


if __name__ == "__main__":
    serve(sys.argv[1])
