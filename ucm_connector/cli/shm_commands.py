"""``ucm shm list|status|stop``: the index servers of this user's ``shm://`` stores.

Owns the three shm commands, the check of a NAME and of the runtime
directory they are given, and their exit statuses.  Everything it knows of
the servers comes from the admin API that ``store_backends`` exports
(``list_servers``, ``server_status``, ``stop_server``...), imported when an
shm command runs: the other commands never load the shm code.

Must not start a server, map a segment or touch blocks; ``stop`` is the one
change it makes, and only after a yes.
"""

from __future__ import annotations

import argparse

from .output import (EXIT_OK, EXIT_PROBLEMS, EXIT_STORE, UserError, confirm, error, nbytes, plural, print_json,
                     print_shm_status_text, shm_list_line)


def _shm_name(name: str) -> str:
    from store_backends import valid_name

    if not valid_name(name):
        raise UserError(f"{name!r} is not an shm store name: letters, digits, '-', '_' and '.', "
                        f"at most 80 characters")
    return name


def _shm_runtime_dir(rundir: str | None) -> str:
    """The runtime directory, refused if others could have planted a server
    in it (the servers' answers are printed and acted on)."""
    from store_backends import UnsafeRuntimeDir, check_runtime_dir

    try:
        return check_runtime_dir(rundir)
    except UnsafeRuntimeDir as exc:
        raise UserError(str(exc)) from None


def cmd_shm_list(args: argparse.Namespace) -> int:
    from store_backends import list_servers, server_status

    directory = _shm_runtime_dir(args.runtime_dir)
    names = list_servers(directory)
    if args.json:
        print_json({"runtime_dir": directory, "running": names}, sort_keys=False)
        return EXIT_OK
    if not names:
        print(f"no shm server is running (runtime dir {directory})")
    for name in names:
        print(shm_list_line(name, server_status(name, directory)))
    return EXIT_OK


def cmd_shm_status(args: argparse.Namespace) -> int:
    from store_backends import server_status

    name = _shm_name(args.name)
    directory = _shm_runtime_dir(args.runtime_dir)
    status = server_status(name, directory)
    if not status.answering:
        raise UserError(
            f"the shm server of {name!r} is running but does not answer; see {status.log_path}"
            if status.running else
            f"no shm server is running for {name!r} (runtime dir {directory}); `ucm shm list` shows the running ones")
    if args.json:
        print_json(status.to_dict())
        return EXIT_OK
    print_shm_status_text(name, status)
    return EXIT_OK


def cmd_shm_stop(args: argparse.Namespace) -> int:
    from store_backends import server_running, server_status, stop_server

    name = _shm_name(args.name)
    directory = _shm_runtime_dir(args.runtime_dir)
    if not server_running(name, directory):
        raise UserError(f"no shm server is running for {name!r} (runtime dir {directory}); nothing to stop")
    status = server_status(name, directory)
    held = (f" and its {plural(status.num_blocks, 'block')} ({nbytes(status.nbytes)})"
            if status.answering else "")
    if not confirm(f"Stop the shm server of {name!r}{held}? Engines using shm://{name} lose those blocks.",
                   args.yes):
        error("not confirmed; the server keeps running (--yes stops it without asking)")
        return EXIT_PROBLEMS
    try:
        stop_server(name, directory, timeout_s=args.timeout)
    except TimeoutError as exc:
        raise UserError(f"{exc}; its pid is in {status.pid_path}", EXIT_STORE) from None
    print(f"stopped the shm server of {name!r}")
    return EXIT_OK
