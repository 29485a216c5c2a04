"""Runs ``ucm explain`` through its module interface (``SUMMARY``, ``HELP``,
``add_arguments``, ``run``): the same code whether or not ``ucm`` has
registered the command, so tests of it need not know how the CLI is built.

    explain("--store", URL, "--model", DIR, "--prompt", "...")  -> Result
    python tests/explain_helper.py --store URL ...                # as a command
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parser() -> argparse.ArgumentParser:
    from ucm_connector import explain as command

    p = argparse.ArgumentParser(prog="ucm explain", description=command.HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(p)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


@dataclasses.dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def report(self) -> dict:
        """The ``--json`` report."""
        return json.loads(self.stdout)


def explain(*argv: str, stdin: str | None = None) -> Result:
    """Parse and run ``ucm explain ARGV`` in this process, capturing its output."""
    from ucm_connector import explain as command

    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = command.run(parse(list(argv)))
            except SystemExit as exc:    # argparse refusing the command line
                rc = exc.code if isinstance(exc.code, int) else 2
    finally:
        sys.stdin = old_stdin
    return Result(rc, out.getvalue(), err.getvalue())


def main(argv: list[str] | None = None) -> int:
    from ucm_connector import explain as command

    return command.run(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
