"""ucm_testing.forkserver: a script forked from the tests' server behaves as
``python SCRIPT ARGS`` would (arguments, environment, working directory,
output, exit status, its own process and session), and a run past its
timeout is killed.  Each case runs forked and, for comparison, with
``python`` (``UCM_TEST_FORKSERVER=0``)."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from ucm_testing.forkserver import run_script

SCRIPT = textwrap.dedent("""\
    import os, sys
    print("argv", sys.argv[1:])
    print("cwd", os.getcwd())
    print("env", os.environ.get("UCM_FORK_TEST"), "HOME" in os.environ)
    print("ids", os.getpid(), os.getsid(0), flush=True)
    print("to stderr", file=sys.stderr)
    what = sys.argv[1]
    if what == "raise":
        raise ValueError("a bad spec")
    if what == "signal":
        os.kill(os.getpid(), 9)
    if what == "sleep":
        import time
        time.sleep(120)
    sys.exit(int(what))
""")


@pytest.fixture(params=["forked", "python"])
def mode(request, monkeypatch):
    monkeypatch.setenv("UCM_TEST_FORKSERVER", "1" if request.param == "forked" else "0")
    return request.param


def _run(tmp_path, *args, timeout=120.0, env_extra=None):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", ""), "UCM_FORK_TEST": "here", **(env_extra or {})}
    return run_script([script, *args], env=env, cwd=cwd, output=tmp_path / f"out-{args[0]}.txt", timeout=timeout)


def _ids(output: str) -> tuple[int, int]:
    line = next(x for x in output.splitlines() if x.startswith("ids "))
    pid, sid = map(int, line.split()[1:])
    return pid, sid


def test_a_script_gets_its_arguments_environment_and_directory_and_returns_its_status(tmp_path, mode):
    done = _run(tmp_path, "3", "two words")
    assert done.rc == 3 and not done.timed_out
    assert "argv ['3', 'two words']" in done.output
    assert f"cwd {tmp_path / 'cwd'}" in done.output
    # The environment given, and nothing else (HOME was not given).
    assert "env here False" in done.output
    assert "to stderr" in done.output
    pid, sid = _ids(done.output)
    assert pid == sid, "the script does not lead a session of its own"
    assert pid != os.getpid()


def test_each_run_is_a_new_process(tmp_path, mode):
    first, second = _run(tmp_path, "0"), _run(tmp_path, "0")
    assert first.rc == second.rc == 0
    assert _ids(first.output)[0] != _ids(second.output)[0]


def test_an_exception_is_exit_status_1_with_its_traceback(tmp_path, mode):
    done = _run(tmp_path, "raise")
    assert done.rc == 1
    assert "ValueError: a bad spec" in done.output


def test_a_script_killed_by_a_signal_reports_no_status(tmp_path, mode):
    done = _run(tmp_path, "signal")
    assert done.rc is None and not done.timed_out


def test_a_run_past_its_timeout_is_killed(tmp_path, mode):
    done = _run(tmp_path, "sleep", timeout=3.0)
    assert done.timed_out and done.rc is None
    pid, _ = _ids(done.output)
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(pid, 0)         # gone once reaped; a zombie answers for a moment
            time.sleep(0.1)
