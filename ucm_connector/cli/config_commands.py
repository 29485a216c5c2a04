"""``ucm config check|reference``: a connector configuration, checked before vLLM starts.

Owns reading the configuration an operator gives (a YAML ``config_file``, a
JSON ``kv_connector_extra_config``, or a whole ``--kv-transfer-config``),
validating it with the connector's own ``UCMConfig`` (so the messages are
the ones the connector gives at start-up), checking that each store could be
opened, and the Markdown configuration reference rendered from
``config.OPTIONS`` (docs/configuration.md is that rendering, checked by a
test).

Must not start a server or create a directory while checking a store: a
``disk://`` store that does not exist yet is probed on an empty temporary
directory, an ``shm://`` store is opened with ``OpenMode.INSPECT``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import urllib.parse

from store_backends import OpenMode, StoreError, StoreOpenError, check_scheme, mask_password, open_store, url_scheme
from store_backends.disk import is_disk_store

from ..config import OPTIONS, UCMConfig, UCMConfigError
from .output import EXIT_OK, EXIT_PROBLEMS, UserError, error, nbytes
from .survey import open_for_cli

_ROLES = ("kv_both", "kv_producer", "kv_consumer")


# -- ucm config check ----------------------------------------------------------------------

def _load_config_argument(text: str) -> tuple[str, dict]:
    """(where it came from, the kv_connector_extra_config to validate)."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise UserError(f"the argument starts like JSON but is not valid JSON: {exc.msg} "
                            f"(line {exc.lineno}, column {exc.colno})", EXIT_PROBLEMS) from None
        return "the JSON argument", _unwrap_transfer_config(data, "the JSON argument")
    if os.path.isfile(text):
        try:
            import yaml

            with open(text, encoding="utf-8-sig") as f:
                data = yaml.safe_load(f)
        except Exception:
            data = None  # UCMConfig reads it again and says what is wrong
        if isinstance(data, dict) and ("kv_connector_extra_config" in data or "kv_connector" in data):
            return f"file {text!r}", _unwrap_transfer_config(data, f"file {text!r}")
        # A config_file: let UCMConfig read it, so that its messages name the
        # file exactly as they do when the connector reads it.
        return f"file {text!r}", {"config_file": text}
    if os.path.exists(text):
        raise UserError(f"{text!r} is not a regular file")
    raise UserError(f"{text!r} is neither a file nor a JSON object: pass a YAML file, a JSON string of "
                    f"kv_connector_extra_config, or a whole --kv-transfer-config JSON")


def _unwrap_transfer_config(data: object, where: str) -> dict:
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(data).__name__}", EXIT_PROBLEMS)
    if "kv_connector_extra_config" not in data and "kv_connector" not in data:
        return data
    connector = data.get("kv_connector")
    if connector is not None and connector != "UCMConnector":
        raise UserError(f"{where}: kv_connector is {connector!r}; this checks UCMConnector configurations "
                        f"(\"kv_connector\": \"UCMConnector\")", EXIT_PROBLEMS)
    role = data.get("kv_role")
    if role is not None and role not in _ROLES:
        raise UserError(f"{where}: kv_role {role!r} is not one of {', '.join(_ROLES)}", EXIT_PROBLEMS)
    module = data.get("kv_connector_module_path")
    if module is not None and module != "ucm_connector.connector":
        raise UserError(f"{where}: kv_connector_module_path is {module!r}; UCMConnector lives in "
                        f"'ucm_connector.connector' (or leave the key out)", EXIT_PROBLEMS)
    extra = data.get("kv_connector_extra_config", {})
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise UserError(f"{where}: kv_connector_extra_config must be an object, got {type(extra).__name__}",
                        EXIT_PROBLEMS)
    return extra


def check_store_url(url: str) -> tuple[bool, str]:
    """Whether the connector could open ``url`` now, and a line saying so.
    Starts no server and creates no directory."""
    shown = mask_password(url)
    try:
        scheme = url_scheme(url)
        if scheme == "disk":
            return _check_disk_url(url, shown)
        if scheme == "shm":
            return _check_shm_url(url, shown)
        with open_store(url) as store:
            stats = store.stats()
        keys = "?" if stats.num_blocks is None else stats.num_blocks
        return True, f"reachable ({keys} keys, {nbytes(stats.nbytes)} used)"
    except StoreError as exc:
        return False, str(exc)


def _disk_path(url: str) -> str | None:
    """The directory of a well-formed disk:// URL (else None: let the store
    explain what is wrong with it)."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    if parts.netloc or not os.path.isabs(path) or path == "/":
        return None
    return path


def _check_disk_url(url: str, shown: str) -> tuple[bool, str]:
    path = _disk_path(url)
    if path is not None and is_disk_store(path):
        opened = open_for_cli(url)
        with opened.store as store:
            stats = store.stats()
        return True, f"a disk store with {stats.num_blocks} keys, {nbytes(stats.nbytes)}"
    # The options are checked by opening the same URL on an empty temporary
    # directory: the store's own messages, and no trace at the real path.
    scratch = tempfile.mkdtemp(prefix="ucm-check-")
    try:
        query = urllib.parse.urlsplit(url).query
        probe = f"disk://{urllib.parse.quote(scratch)}" + (f"?{query}" if query else "")
        if path is None:
            probe = url  # malformed: the store says why before touching anything
        try:
            open_store(probe).close()
        except StoreError as exc:
            raise StoreOpenError(str(exc).replace(mask_password(probe), shown)) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if path is None:
        return False, f"store '{shown}': write it like disk:///var/cache/ucm"
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            return False, f"store '{shown}': the directory {path!r} is not writable"
        return True, f"{path!r} exists; the connector makes it a disk store at start-up"
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return False, f"store '{shown}': cannot create {path!r}: {parent!r} is not a writable directory"
    return True, f"{path!r} does not exist yet; the connector creates it"


def _check_shm_url(url: str, shown: str) -> tuple[bool, str]:
    from store_backends import ShmServerNotRunning

    try:
        with open_store(url, OpenMode.INSPECT) as store:
            stats = store.stats()
    except ShmServerNotRunning as exc:
        name = exc.name
        if not exc.starts_one:
            return False, (f"store '{shown}': no shm server is running for {name!r} and server=connect does "
                           f"not start one; start it with `python -m store_backends.shm_server serve {name}`")
        return True, f"no shm server is running for {name!r} yet; the connector starts one"
    return True, (f"shm server running ({stats.num_blocks} blocks, {nbytes(stats.nbytes)} of "
                  f"{nbytes(stats.capacity_nbytes)})")


def cmd_config_check(args: argparse.Namespace) -> int:
    where, extra = _load_config_argument(args.config)
    try:
        config = UCMConfig.from_extra_config(extra)
    except UCMConfigError as exc:
        error(f"invalid connector configuration: {exc}")
        return EXIT_PROBLEMS
    print(f"the UCMConnector configuration in {where} is valid:")
    width = max(len(o.name) for o in OPTIONS)
    for option in OPTIONS:
        value = getattr(config, option.name)
        if option.name == "store":
            value = [mask_password(u) for u in config.store_urls]
            value = value[0] if len(value) == 1 else value
        shown = "none" if value is None else value if isinstance(value, str) else json.dumps(value)
        print(f"  {option.name:<{width}}  {shown}")
    if args.no_connect:
        status = EXIT_OK
        for url in config.store_urls:
            try:
                check_scheme(url)
            except StoreOpenError as exc:
                error(str(exc))
                status = EXIT_PROBLEMS
        print("stores not opened (--no-connect): only their URLs' schemes were checked, not their options, "
              "hosts or ports")
        return status
    status = EXIT_OK
    for url in config.store_urls:
        ok, line = check_store_url(url)
        if ok:
            print(f"store {mask_password(url)}: {line}")
        else:
            error(line)
            status = EXIT_PROBLEMS
    return status


# -- ucm config reference ------------------------------------------------------------------

def render_configuration_reference() -> str:
    """docs/configuration.md, from ``config.OPTIONS``: the one place the
    options are described, so the reference cannot drift from the code."""

    def cell(text: object) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [
        "# Connector configuration reference",
        "",
        "<!-- Generated from ucm_connector.config.OPTIONS by `ucm config reference`;",
        "     do not edit by hand (tests/test_docs.py checks it). -->",
        "",
        "UCMConnector reads its options from `kv_connector_extra_config` in vLLM's",
        "`--kv-transfer-config`, and from the YAML file that `config_file` names (keys in",
        "`kv_connector_extra_config` win). An unknown key or a bad value stops start-up",
        "with a message that names the key; `ucm config check` gives the same message",
        "without starting vLLM.",
        "",
        "| key | value | default | meaning |",
        "|---|---|---|---|",
    ]
    for option in OPTIONS:
        if option.default is not None:
            default = f"`{json.dumps(option.default)}`"
        else:
            # A default computed at start-up (the store's) is described in the help.
            default = "see meaning" if "Default:" in option.help else "none"
        lines.append(f"| `{option.name}` | {cell(option.kind)} | {cell(default)} | {cell(option.help)} |")
    lines += [
        "",
        "Store URLs (`disk://`, `redis://`, `rediss://`, `unix://`, `redis-cluster://`,",
        "`shm://` and third-party schemes) and their options are described in",
        "[stores.md](stores.md).",
        "",
        "## Examples",
        "",
        "On the command line:",
        "",
        "```",
        "--kv-transfer-config '{\"kv_connector\":\"UCMConnector\",\"kv_role\":\"kv_both\",",
        "  \"kv_connector_extra_config\":{\"store\":[\"shm://ucm?capacity=4GiB\",",
        "                                           \"disk:///var/cache/ucm?capacity=200GiB\"],",
        "                               \"min_hit_blocks\":2}}'",
        "```",
        "",
        "The same in a file (`\"kv_connector_extra_config\":{\"config_file\":\"/etc/ucm.yaml\"}`):",
        "",
        "```yaml",
        "store:",
        "  - shm://ucm?capacity=4GiB",
        "  - disk:///var/cache/ucm?capacity=200GiB",
        "min_hit_blocks: 2",
        "```",
        "",
        "Check either before starting vLLM (the stores are opened too; `--no-connect`",
        "skips that, and with it the check of each store URL's options, host and port,",
        "which a store makes as it opens):",
        "",
        "```",
        "ucm config check /etc/ucm.yaml",
        "ucm config check '{\"store\": \"redis://cache-1:6379/0\"}'",
        "```",
        "",
    ]
    return "\n".join(lines)


def cmd_config_reference(args: argparse.Namespace) -> int:
    sys.stdout.write(render_configuration_reference())
    return EXIT_OK
