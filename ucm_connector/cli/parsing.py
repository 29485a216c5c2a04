"""The ``ucm`` command line: every command, option and help text.

Owns ``build_parser`` (the commands and their options, each command bound to
its function in ``store_commands``, ``config_commands`` or
``shm_commands``), the help texts (docs quote them, and tests parse every
``ucm`` line of the docs with this parser), the ``shm`` NAME that may start
with '-', and the registration of ``ucm explain`` from
``ucm_connector.explain``.

Must not run a command, open a store or print anything but argparse's own
help and usage errors.
"""

from __future__ import annotations

import argparse
import re
import shutil
from typing import Callable

from .. import __version__, explain
from .config_commands import cmd_config_check, cmd_config_reference
from .shm_commands import cmd_shm_list, cmd_shm_status, cmd_shm_stop
from .store_commands import cmd_store_clear, cmd_store_stats, cmd_store_verify

_DESCRIPTION = """\
Operate the KV stores and configuration of ucm-connector, the vLLM KV-cache
connector, without starting vLLM: see what a shared cache holds and for which
models, check every stored block, clear it (or one model's namespace), check a
connector configuration, and manage shm:// servers.

Every stored block carries a header with its namespace (a digest of the model
fingerprint, dtype, KV layout, block size, geometry and TP rank) and a checksum.
Engines leave a small manifest per namespace in the store, so that `ucm store
stats` can name the model behind each digest."""

_EPILOG = """\
commands:
  store stats URL          blocks, bytes and last use per namespace; capacity and use
  store verify URL         read every block and check its header and checksum
                           (--repair removes the bad ones)
  store clear URL          delete every block, or one namespace's (--namespace);
                           asks first unless --yes
  config check CONFIG      validate a connector configuration and open its stores
  config reference         print the configuration reference (Markdown)
  shm list                 running shm:// servers of this user
  shm status NAME          one shm:// server's figures
  shm stop NAME            stop an shm:// server (its blocks are dropped)
  explain --store URL --model DIR --prompt TEXT
                           why a prompt would (partly) miss the store, block by block

  `ucm COMMAND SUBCOMMAND --help` (`ucm explain --help`) describes each one's options.

store URLs:
  disk:///abs/path  redis://[user:pass@]host:port/db  rediss://...
  unix:///path/redis.sock  redis-cluster://host:port[,host:port...]  shm://NAME
  and schemes registered under the entry-point group ucm_connector.stores.
  ucm never starts an shm:// server, and never evicts from a disk:// store
  down to the capacity its URL names.

examples:
  ucm store stats disk:///var/cache/ucm
  ucm store stats redis://cache-1:6379/0 --json
  ucm store verify shm://ucm --repair
  ucm store clear disk:///var/cache/ucm --namespace smollm2-135m
  ucm store clear redis://cache-1:6379/0 --namespace 3fa4c0e1 --yes
  ucm config check /etc/ucm.yaml
  ucm config check '{"kv_connector":"UCMConnector","kv_role":"kv_both",
                     "kv_connector_extra_config":{"store":"redis://cache-1:6379/0"}}'
  ucm shm status ucm

exit status:
  0    success
  1    problems found: bad blocks left in place (verify), an invalid
       configuration or unreachable store (config check), a question
       answered no (clear, shm stop)
  2    bad command line or input: a malformed URL, a store that cannot be
       opened (no such directory, server unreachable, wrong password), an
       unknown namespace, a server that is not running
  3    the store failed during the command, or cannot list its blocks
  4    the store holds blocks of a newer format version: upgrade ucm-connector
  130  interrupted

environment:
  UCM_SHM_RUNTIME_DIR  where shm:// servers keep their sockets and lock files
                       (else $XDG_RUNTIME_DIR/ucm-shm, else /tmp/ucm-shm-UID)

See docs/stores.md, docs/configuration.md and docs/troubleshooting.md."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=min(100, shutil.get_terminal_size().columns))


def _add_progress(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--progress", dest="progress", action="store_true", default=None,
                       help="show progress on stderr (the default when stderr is a terminal)")
    group.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")


# -- shm NAMEs that start with '-' ------------------------------------------------------------

def _add_shm_name(parser: argparse.ArgumentParser) -> None:
    # Optional for argparse only: take_shm_name finds a NAME that starts
    # with '-', and says it is missing otherwise.
    parser.add_argument("name", metavar="NAME", nargs="?",
                        help="the store's NAME (shm://NAME); `-- NAME` if it is also one of the options")
    parser.set_defaults(shm_name_parser=parser)


def take_shm_name(args: argparse.Namespace, extras: list[str]) -> list[str]:
    """``ucm shm status -cache``: shm names may start with '-', and argparse
    reads such a NAME as an unknown option.  When NAME is missing, the first
    unknown token that is a valid name is the NAME; the other extras are
    returned (and refused).  ``-- NAME`` always works, also for a NAME that is
    one of the command's options (``-y``)."""
    from store_backends import valid_name

    if args.name is None:
        for i, token in enumerate(extras):
            if valid_name(token):
                args.name = token
                return extras[:i] + extras[i + 1:]
        args.shm_name_parser.error("the following arguments are required: NAME")
    return extras


# -- ucm explain --------------------------------------------------------------------------------

def _add_explain(groups: argparse._SubParsersAction) -> None:
    """``ucm explain ...``, a top-level command (not under a group) that
    ``ucm_connector/explain.py`` implements: its ``add_arguments(parser)``
    adds the options, its ``run(args)`` is the command and returns the exit
    status; ``HELP`` is the description, the first sentence of ``SUMMARY``
    the one-line help."""
    parser = groups.add_parser("explain", help=_first_sentence(explain.SUMMARY), description=explain.HELP,
                               formatter_class=_Formatter)
    explain.add_arguments(parser)
    parser.set_defaults(func=explain.run)


def _first_sentence(text: str | None) -> str | None:
    if not text:
        return None
    return " ".join(re.split(r"(?<=\.)\s", text.strip(), maxsplit=1)[0].split()).rstrip(".")


# -- the parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ucm", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"ucm (ucm-connector) {__version__}")
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)

    def sub(group: argparse._SubParsersAction, name: str, func: Callable, summary: str, text: str,
            examples: str) -> argparse.ArgumentParser:
        p = group.add_parser(name, help=summary, description=text, epilog="examples:\n" + examples,
                             formatter_class=_Formatter)
        p.set_defaults(func=func)
        return p

    def group(name: str, summary: str, text: str) -> argparse._SubParsersAction:
        """A command group (``ucm store ...``) and its subcommands."""
        parser = groups.add_parser(name, help=summary, description=text, formatter_class=_Formatter)
        return parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    store_cmds = group("store", "inspect, verify and clear a KV store",
                       "Inspect, verify and clear a KV store given by its URL.")
    p = sub(store_cmds, "stats", cmd_store_stats, "blocks, bytes and last use per namespace",
            "Walk every key of the store, read each block's 64-byte header (not the whole block), and\n"
            "report per namespace: blocks, bytes, oldest and newest use (where the store keeps them:\n"
            "disk:// and Redis), and the model, layout and TP rank from the namespace's manifest.\n"
            "Also the store's own figures: bytes used and capacity.",
            "  ucm store stats disk:///var/cache/ucm\n  ucm store stats redis://cache-1:6379/0 --json")
    p.add_argument("url", metavar="URL", help="the store's URL")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_progress(p)

    p = sub(store_cmds, "verify", cmd_store_verify, "check every block's header and checksum",
            "Read every block whole and check its envelope: magic, format version, header checksum,\n"
            "payload size and checksum, and that it is stored under the key it was written for.\n"
            "Manifests are checked too. Each bad entry is printed as one line; --repair deletes them.\n"
            "Blocks of a newer format version are not bad: they are left alone, and the exit status\n"
            "says to upgrade. Reading does not count as a use for LRU (except on Redis before 7.2).",
            "  ucm store verify disk:///var/cache/ucm\n  ucm store verify shm://ucm --repair --progress")
    p.add_argument("url", metavar="URL", help="the store's URL")
    p.add_argument("--repair", action="store_true", help="delete the bad blocks (only those)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--batch", type=int, default=32, metavar="N",
                   help="blocks read at once (default 32; memory is N x block size)")
    _add_progress(p)

    p = sub(store_cmds, "clear", cmd_store_clear, "delete every block, or one namespace's",
            "Delete every key of the store (blocks and manifests), or with --namespace only the\n"
            "blocks and manifest of the namespaces named. NAMESPACE is a digest or a prefix of 4+ hex\n"
            "digits of one (as `ucm store stats` prints), a model name or the last part of a model\n"
            "path from the manifests (all TP ranks of that model), or a model fingerprint prefix.\n"
            "Asks before deleting unless --yes; an unknown namespace deletes nothing.",
            "  ucm store clear disk:///var/cache/ucm\n"
            "  ucm store clear redis://cache-1:6379/0 --namespace 3fa4c0e1 --yes\n"
            "  ucm store clear shm://ucm --namespace smollm2-135m")
    p.add_argument("url", metavar="URL", help="the store's URL")
    p.add_argument("--namespace", action="append", metavar="NAMESPACE",
                   help="only this namespace (repeat for more)")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask")
    _add_progress(p)

    config_cmds = group("config", "check a connector configuration; print the reference",
                        "Check connector configurations; print the configuration reference.")
    p = sub(config_cmds, "check", cmd_config_check, "validate a connector configuration",
            "Validate a connector configuration without starting vLLM, with the messages the\n"
            "connector gives at start-up. CONFIG is a YAML file of kv_connector_extra_config keys\n"
            "(what config_file names), a JSON string of kv_connector_extra_config, or a whole\n"
            "--kv-transfer-config JSON (or YAML file) with kv_connector_extra_config inside.\n"
            "Then each store is opened to see that the connector could use it (no shm:// server is\n"
            "started and no directory created); --no-connect skips that, and with it the check of\n"
            "each URL's options, host and port, which the store makes as it opens: only the URL's\n"
            "scheme is checked then.",
            "  ucm config check /etc/ucm.yaml\n"
            "  ucm config check '{\"store\": [\"shm://ucm\", \"disk:///var/cache/ucm\"]}'\n"
            "  ucm config check \"$KV_TRANSFER_CONFIG\" --no-connect")
    p.add_argument("config", metavar="CONFIG", help="a YAML file or a JSON string")
    p.add_argument("--no-connect", action="store_true",
                   help="do not open the stores (only their URLs' schemes are checked)")
    sub(config_cmds, "reference", cmd_config_reference, "print the configuration reference (Markdown)",
        "Print the reference of every connector option, rendered from the code's option table;\n"
        "docs/configuration.md is this output.",
        "  ucm config reference > docs/configuration.md")

    shm_cmds = group("shm", "list, inspect and stop shm:// servers",
                     "Manage the index servers of shm:// stores. Each shm://NAME store lives in a /dev/shm "
                     "segment owned by one server process per NAME and host; its blocks last as long as the "
                     "server.")
    p = sub(shm_cmds, "list", cmd_shm_list, "running shm:// servers",
            "List the shm:// servers running in the runtime directory, with their blocks and use.",
            "  ucm shm list")
    p.add_argument("--runtime-dir", metavar="DIR", help="where the servers' sockets are (see ENVIRONMENT)")
    p.add_argument("--json", action="store_true", help="print the names as JSON")
    p = sub(shm_cmds, "status", cmd_shm_status, "one server's figures",
            "Show the figures of the server of shm://NAME: blocks, bytes, capacity, hits, evictions,\n"
            "open write leases.",
            "  ucm shm status ucm\n  ucm shm status ucm --json")
    _add_shm_name(p)
    p.add_argument("--runtime-dir", metavar="DIR", help="where the server's socket is")
    p.add_argument("--json", action="store_true", help="print the server's figures as JSON")
    p.usage = "%(prog)s [-h] [--runtime-dir DIR] [--json] NAME"
    p = sub(shm_cmds, "stop", cmd_shm_stop, "stop a server (its blocks are dropped)",
            "Stop the server of shm://NAME and wait until it has removed its segment. Its blocks are\n"
            "gone; engines using the store see misses, and the next one to open it starts a new,\n"
            "empty server (with server=embedded). Asks first unless --yes.",
            "  ucm shm stop ucm --yes")
    _add_shm_name(p)
    p.add_argument("--runtime-dir", metavar="DIR", help="where the server's socket is")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for it to exit (default 10)")
    p.usage = "%(prog)s [-h] [--runtime-dir DIR] [--yes] [--timeout S] NAME"

    _add_explain(groups)
    return parser
