"""``ucm``: the operator's command for ucm-connector's KV stores and configs.

``ucm store stats|verify|clear``, ``ucm config check|reference``, ``ucm shm
list|status|stop`` (and ``ucm explain`` where ``ucm_connector.explain``
exists).  The package, one idea per module:

* ``parsing``: the commands, their options and help texts (``build_parser``);
* ``store_commands``, ``config_commands``, ``shm_commands``: one module per
  command group, each command a function ``args -> exit status``;
* ``survey``: opening a store for inspection and walking it, shared by the
  store commands, and the dataclasses of what they found;
* ``output``: exit statuses, errors, the text and ``--json`` forms of the
  reports, the progress line (``store_backends.Progress``).

This module owns ``main``: parse, run the command, and turn the errors a
user can hit into one line on stderr, ``ucm: ...``, saying what to do, with
the exit status ``ucm --help`` lists; never a traceback.

What the package must not do: import vLLM or torch (it starts in a fraction
of a second on machines without either), start servers (an ``shm://`` store
is opened with ``OpenMode.INSPECT``), change a store except where a command
says so (``verify --repair``, ``clear``, ``shm stop``), or reach into a
store backend: it uses only what ``store_backends`` exports (and
``store_backends.disk.is_disk_store``).  ``OpenMode.INSPECT`` opens only a
store that exists, evicts nothing (a ``disk://`` store is not cut down to
the capacity its URL names) and starts no server.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from store_backends import StoreError, StoreOpenError

from .config_commands import check_store_url, cmd_config_check, cmd_config_reference, render_configuration_reference
from .output import (EXIT_INTERRUPTED, EXIT_NEWER, EXIT_OK, EXIT_PROBLEMS, EXIT_STORE, EXIT_USAGE, UserError,
                     error)
from .parsing import build_parser, take_shm_name
from .shm_commands import cmd_shm_list, cmd_shm_status, cmd_shm_stop
from .store_commands import cmd_store_clear, cmd_store_stats, cmd_store_verify, resolve_namespaces
from .survey import (BadEntry, NamespaceRow, Opened, StatsReport, Survey, Usage, ValueCheck, Verdict, VerifyCounts,
                     VerifyReport, check_value, open_for_cli, survey)

__all__ = [
    "EXIT_INTERRUPTED", "EXIT_NEWER", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_STORE", "EXIT_USAGE",
    "BadEntry", "NamespaceRow", "Opened", "StatsReport", "Survey", "Usage", "UserError", "ValueCheck", "Verdict",
    "VerifyCounts", "VerifyReport",
    "build_parser", "check_store_url", "check_value", "cmd_config_check", "cmd_config_reference", "cmd_shm_list",
    "cmd_shm_status", "cmd_shm_stop", "cmd_store_clear", "cmd_store_stats", "cmd_store_verify", "main",
    "open_for_cli", "render_configuration_reference", "resolve_namespaces", "run_command", "survey",
]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if getattr(args, "shm_name_parser", None) is not None:
        extras = take_shm_name(args, extras)
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if getattr(args, "batch", 1) < 1:
        parser.error("--batch must be at least 1")
    return run_command(args.func, args)


def run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``command(args)``, with the errors a user can hit said in one line
    on stderr and turned into their exit status (``ucm explain`` runs
    through here also when it is called on its own)."""
    try:
        return command(args)
    except UserError as exc:
        error(exc)
        return exc.status
    except StoreOpenError as exc:
        error(exc)
        return EXIT_USAGE
    except StoreError as exc:
        error(exc)
        return EXIT_STORE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `ucm ... | head`: the reader has gone; exit quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
