"""Running a vLLM OpenAI server as a child process: the pieces `make run`
(``scripts/demo.py``) and ``benchmarks/serving_bench.py`` share.  The
server is started by the caller with ``start_new_session=True``, so that its
engine processes share its process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, n: int = 30) -> str:
    """The last ``n`` lines of a log, for an error message."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def wait_health(base: str, proc: subprocess.Popen, log_path: str, timeout: float,
                progress: bool = False) -> None:
    """Until ``base``/health answers 200; raises with the log's last lines if
    the server exits first, or after ``timeout`` seconds.  ``progress``
    prints a dot a second and the seconds waited every ten."""
    start = time.monotonic()
    shown = 0
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with status {proc.returncode} while starting; "
                               f"last lines of {log_path}:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    if progress:
                        print(flush=True)
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
        while progress and shown < int(time.monotonic() - start):
            shown += 1
            print("." if shown % 10 else f" {shown} s", end="", flush=True)
    raise RuntimeError(f"the vLLM server did not answer /health within {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        # SIGTERM to the API server alone: it shuts its engine down itself
        # (vLLM 0.32 still logs an EngineDeadError from its output handler as
        # the engine goes; serving_bench counts such lines apart, as
        # shutdown errors).  SIGTERM, not SIGINT: a shell starts background
        # jobs with SIGINT ignored.
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    try:                                        # engine processes that outlived the server
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
