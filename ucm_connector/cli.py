"""``ucm``: the operator's command for ucm-connector's KV stores and configs.

Owns the command line: ``ucm store stats|verify|clear``, ``ucm config
check|reference``, ``ucm shm list|status|stop``, their output, their exit
statuses, and the Markdown configuration reference rendered from
``config.OPTIONS`` (docs/configuration.md is that rendering, checked by a
test).

What it must not do: import vLLM or torch (it starts in a fraction of a
second on machines without either), start servers (an ``shm://`` store is
opened with ``OpenMode.INSPECT``), or change a store except where a command
says so (``verify --repair``, ``clear``, ``shm stop``). ``OpenMode.INSPECT``
opens only a store that exists, evicts nothing (a ``disk://`` store is not
cut down to the capacity its URL names) and starts no server.

User errors (a wrong URL, an unreachable server, an unknown namespace) are
one line on stderr, ``ucm: ...``, saying what to do; never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import string
import sys
import tempfile
import time
import urllib.parse
from typing import Callable, Iterable

from store_backends import KVStore, OpenMode, StoreError, StoreOpenError, open_store
from store_backends.disk import is_disk_store
from store_backends.registry import url_scheme
from store_backends.urls import mask_password

from . import __version__, blockfmt
from .config import OPTIONS, UCMConfig, UCMConfigError
from .manifest import (Manifest, ManifestError, NewerManifestError, describe, digest_of, is_manifest_key,
                       parse_manifest, read_manifests)

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_STORE = 3
EXIT_NEWER = 4
EXIT_INTERRUPTED = 130

_LIST_BATCH = 1000
_HEAD_BATCH = 1000
_DELETE_BATCH = 1000
_HEX = set(string.hexdigits)


class UserError(Exception):
    """Something the user can fix; printed as one line, exit ``status``."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


# -- small output helpers ------------------------------------------------------

def _error(message: object) -> None:
    text = " ".join(str(message).split())
    print(f"ucm: {text}", file=sys.stderr)


def _nbytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class Progress:
    """A one-line progress report on stderr, redrawn at most five times a
    second; silent unless enabled."""

    def __init__(self, enabled: bool, label: str, total: int | None = None) -> None:
        self.enabled = enabled
        self.label = label
        self.total = total if total else None
        self.count = 0
        self._last = 0.0
        self._width = 0

    def add(self, n: int) -> None:
        self.count += n
        now = time.monotonic()
        if self.enabled and now - self._last >= 0.2:
            self._last = now
            self._draw()

    def _draw(self) -> None:
        if self.total:
            frac = min(1.0, self.count / self.total)
            bar = "#" * int(frac * 24)
            text = f"{self.label}: [{bar:<24}] {self.count}/{self.total} keys ({frac:.0%})"
        else:
            text = f"{self.label}: {self.count} keys"
        self._width = max(self._width, len(text))
        sys.stderr.write("\r" + text.ljust(self._width))
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()


def _progress(args: argparse.Namespace, label: str, store: KVStore | None = None) -> Progress:
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    total = None
    if enabled and store is not None:
        try:
            stats = store.stats()
            # Redis counts every key of the database, not the store's namespace.
            if stats.num_blocks is not None and stats.counts_this_store:
                total = stats.num_blocks
        except StoreError:
            pass
    return Progress(enabled, label, total)


# -- opening stores --------------------------------------------------------------

@dataclasses.dataclass
class Opened:
    store: KVStore
    shown: str                       # the user's URL, password masked


def _disk_path(url: str) -> str | None:
    """The directory of a well-formed disk:// URL (else None: let the store
    explain what is wrong with it)."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    if parts.netloc or not os.path.isabs(path) or path == "/":
        return None
    return path


def open_for_cli(url: str) -> Opened:
    """Open a store for inspection, without side effects beyond reading."""
    url = url.strip()
    return Opened(open_store(url, OpenMode.INSPECT), mask_password(url))


# -- walking a store -------------------------------------------------------------

@dataclasses.dataclass
class Usage:
    """Blocks of one kind (a namespace, a newer format, damaged...)."""

    num_blocks: int = 0
    nbytes: int = 0
    oldest_use: float | None = None
    newest_use: float | None = None
    keys: list[bytes] = dataclasses.field(default_factory=list)

    def add(self, key: bytes, nbytes: int, when: float | None, keep_key: bool) -> None:
        self.num_blocks += 1
        self.nbytes += nbytes
        if when is not None:
            self.oldest_use = when if self.oldest_use is None else min(self.oldest_use, when)
            self.newest_use = when if self.newest_use is None else max(self.newest_use, when)
        if keep_key:
            self.keys.append(key)

    def to_dict(self) -> dict:
        return {"num_blocks": self.num_blocks, "nbytes": self.nbytes,
                "oldest_use": self.oldest_use, "newest_use": self.newest_use}


@dataclasses.dataclass
class Survey:
    """What a walk over every key's header found."""

    num_keys: int = 0
    namespaces: dict[bytes, Usage] = dataclasses.field(default_factory=dict)
    manifest_keys: dict[bytes, bytes] = dataclasses.field(default_factory=dict)  # digest -> key
    manifests: dict[bytes, Manifest] = dataclasses.field(default_factory=dict)
    # Manifests that cannot be used (see manifest.parse_manifest): not shown,
    # counted, and removed by `verify --repair`.
    bad_manifests: dict[bytes, ManifestError] = dataclasses.field(default_factory=dict)
    newer: dict[int, Usage] = dataclasses.field(default_factory=dict)
    damaged: Usage = dataclasses.field(default_factory=Usage)
    foreign: Usage = dataclasses.field(default_factory=Usage)

    def digests(self) -> list[bytes]:
        return list(dict.fromkeys([*self.namespaces, *self.manifest_keys]))


def _classify(size: int, head: bytes) -> tuple[str, bytes | int | None]:
    """("block", namespace digest), ("newer", version), ("damaged", None)
    or ("foreign", None: not a UCM block at all), from the first 64 bytes."""
    try:
        header = blockfmt.parse_header(head)
    except blockfmt.UnsupportedVersionError as exc:
        return ("newer", exc.version) if exc.version > blockfmt.FORMAT_VERSION else ("damaged", None)
    except blockfmt.BadMagicError:
        return "foreign", None
    except blockfmt.BlockFormatError:
        return "damaged", None
    if size != blockfmt.block_nbytes(header.payload_nbytes):
        return "damaged", None
    return "block", header.namespace_digest


def survey(store: KVStore, progress: Progress, keep_keys: bool = False) -> Survey:
    """Read every key's header (64 bytes each, not whole blocks) and when it
    was last used, grouped by namespace."""
    found = Survey()
    for keys in store.iter_keys(_LIST_BATCH):
        found.num_keys += len(keys)
        blocks = []
        for key in keys:
            if is_manifest_key(key):
                found.manifest_keys[digest_of(key)] = key
            else:
                blocks.append(key)
        for part in _chunks(blocks, _HEAD_BATCH):
            # Times first: on Redis before 7.2 reading a value resets its idle time.
            times = store.last_used(part)
            heads = store.peek(part, blockfmt.HEADER_NBYTES)
            for key, head, when in zip(part, heads, times):
                if head is None:
                    continue  # gone since it was listed
                kind, what = _classify(*head)
                if kind == "block":
                    usage = found.namespaces.setdefault(what, Usage())
                elif kind == "newer":
                    usage = found.newer.setdefault(what, Usage())
                else:
                    usage = found.damaged if kind == "damaged" else found.foreign
                usage.add(key, head[0], when, keep_keys)
        progress.add(len(keys))
    progress.close()
    for digest, manifest in read_manifests(store, found.digests()).items():
        if isinstance(manifest, Manifest):
            found.manifests[digest] = manifest
        elif not isinstance(manifest, NewerManifestError):
            found.bad_manifests[digest] = manifest
    return found


def _newer_message(shown: str, newer: dict[int, Usage]) -> str:
    count = sum(u.num_blocks for u in newer.values())
    versions = ", ".join(str(v) for v in sorted(newer))
    blocks = _plural(count, "block")
    return (f"store '{shown}' holds {blocks} of format version {versions}, newer than this build reads "
            f"({blockfmt.FORMAT_VERSION}): upgrade ucm-connector (pip install -U ucm-connector) to read them; "
            f"they were left in place")


# -- ucm store stats ---------------------------------------------------------------

def _namespace_rows(found: Survey) -> list[dict]:
    rows = []
    for digest in found.digests():
        usage = found.namespaces.get(digest, Usage())
        manifest = found.manifests.get(digest)
        if not usage.num_blocks and manifest is None:
            continue  # only a manifest that cannot be read: no namespace to show
        bad = found.bad_manifests.get(digest)
        rows.append({
            "digest": digest.hex(),
            **usage.to_dict(),
            "manifest": manifest.to_dict() if manifest else None,
            "description": describe(manifest) if manifest else None,
            "bad_manifest": str(bad) if bad else None,
        })
    rows.sort(key=lambda r: (-r["nbytes"], r["digest"]))
    return rows


def cmd_store_stats(args: argparse.Namespace) -> int:
    opened = open_for_cli(args.url)
    with opened.store as store:
        found = survey(store, _progress(args, "stats", store))
        stats = store.stats()
    rows = _namespace_rows(found)
    capacity = stats.capacity_nbytes
    num_blocks = sum(u.num_blocks for u in found.namespaces.values())
    nbytes = sum(u.nbytes for u in found.namespaces.values())
    if args.json:
        report = {
            "url": opened.shown,
            "num_keys": found.num_keys,
            "num_blocks": num_blocks,
            "nbytes": nbytes,
            "capacity_nbytes": capacity,
            "namespaces": rows,
            "newer_format": [{"version": v, **u.to_dict()} for v, u in sorted(found.newer.items())],
            "damaged": found.damaged.to_dict(),
            "bad_manifests": len(found.bad_manifests),
            "not_ucm": found.foreign.to_dict(),
            "store": {**stats.to_dict(), "url": mask_password(stats.url)},
        }
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        _print_stats(opened, found, rows, stats, capacity, num_blocks, nbytes)
    if found.newer:
        _error(_newer_message(opened.shown, found.newer))
        return EXIT_NEWER
    return EXIT_OK


def _print_stats(opened: Opened, found: Survey, rows: list[dict], stats, capacity: int | None,
                 num_blocks: int, nbytes: int) -> None:
    print(f"store {opened.shown}")
    print(f"  {_plural(len(found.namespaces), 'namespace')}, {_plural(num_blocks, 'block')}, {_nbytes(nbytes)} "
          f"of blocks ({_plural(found.num_keys, 'key')} in all)")
    used = stats.nbytes
    line = f"  the store reports {_nbytes(used)} used"
    if capacity:
        share = f", {100 * used / capacity:.1f}% used" if used is not None else ""
        line += f" of a capacity of {_nbytes(capacity)}{share}"
    else:
        line += ", no capacity set"
    if not stats.counts_this_store:
        line += f" ({stats.counts_scope})"
    print(line)
    if stats.read_only:
        print(f"  read-only: {stats.read_only}")
    if rows:
        print()
        print(f"{'NAMESPACE':<16}  {'BLOCKS':>8}  {'BYTES':>10}  {'OLDEST USE':<19}  {'NEWEST USE':<19}  "
              f"DESCRIPTION")
        for row in rows:
            print(f"{row['digest'][:16]:<16}  {row['num_blocks']:>8}  {_nbytes(row['nbytes']):>10}  "
                  f"{_when(row['oldest_use']):<19}  {_when(row['newest_use']):<19}  "
                  f"{row['description'] or ('(bad manifest)' if row['bad_manifest'] else '(no manifest)')}")
    notes = []
    for version, usage in sorted(found.newer.items()):
        notes.append(f"format v{version} (newer than this build): {_plural(usage.num_blocks, 'block')}, "
                     f"{_nbytes(usage.nbytes)}")
    if found.damaged.num_blocks:
        notes.append(f"damaged headers: {_plural(found.damaged.num_blocks, 'block')}, "
                     f"{_nbytes(found.damaged.nbytes)} (`ucm store verify --repair` removes them)")
    if found.bad_manifests:
        notes.append(f"bad manifests: {len(found.bad_manifests)} (`ucm store verify` says what is wrong, "
                     f"`--repair` removes them)")
    if found.foreign.num_blocks:
        notes.append(f"not ucm blocks: {_plural(found.foreign.num_blocks, 'key')}, {_nbytes(found.foreign.nbytes)}")
    if notes:
        print()
        for note in notes:
            print(note)


# -- ucm store verify --------------------------------------------------------------

def check_value(key: bytes, value: bytes) -> tuple[str, str, bytes | None]:
    """("good" | "manifest" | "bad" | "newer", what is wrong, namespace digest)."""
    if is_manifest_key(key):
        try:
            parse_manifest(value, digest_of(key))
        except NewerManifestError:
            pass  # a newer build's: not damage, never removed
        except ManifestError as exc:
            return "bad", f"bad manifest: {exc}", digest_of(key)
        return "manifest", "", digest_of(key)
    try:
        header = blockfmt.parse_header(value)
    except blockfmt.UnsupportedVersionError as exc:
        if exc.version > blockfmt.FORMAT_VERSION:
            return "newer", str(exc), None
        return "bad", str(exc), None
    except blockfmt.BlockFormatError as exc:
        return "bad", str(exc), None
    try:
        blockfmt.verify(value, header.namespace_digest, key=key)
    except blockfmt.BlockFormatError as exc:
        return "bad", str(exc), header.namespace_digest
    return "good", "", header.namespace_digest


def cmd_store_verify(args: argparse.Namespace) -> int:
    opened = open_for_cli(args.url)
    counts = {"good": 0, "manifest": 0, "bad": 0, "newer": 0, "removed": 0}
    newer: dict[int, Usage] = {}
    bad: list[dict] = []
    with opened.store as store:
        progress = _progress(args, "verify", store)
        for keys in store.iter_keys(_LIST_BATCH):
            for part in _chunks(keys, args.batch):
                problems: list[tuple[bytes, str, bytes | None]] = []
                unread: list[bytes] = []
                values = store.peek(part, None)
                missed = [i for i, got in enumerate(values) if got is None]
                if missed:
                    # Once more: a value evicted or replaced during the read
                    # (shm) reads as a miss, not as damage.
                    for i, got in zip(missed, store.peek([part[i] for i in missed], None)):
                        values[i] = got
                for key, got in zip(part, values):
                    if got is None:
                        unread.append(key)
                        continue
                    verdict, why, digest = check_value(key, got[1])
                    counts[verdict] += 1
                    if verdict == "bad":
                        problems.append((key, why, digest))
                    elif verdict == "newer":
                        version = int.from_bytes(got[1][4:6], "little")
                        newer.setdefault(version, Usage()).add(key, got[0], None, False)
                if unread:
                    # Listed but unreadable: a damaged entry, unless it was
                    # removed or evicted in between.
                    for key, present in zip(unread, store.contains(unread)):
                        if present:
                            counts["bad"] += 1
                            problems.append((key, "unreadable: the store holds the key but cannot read its value",
                                             None))
                if problems and args.repair:
                    store.delete([key for key, _, _ in problems])
                    counts["removed"] += len(problems)
                for key, why, digest in problems:
                    entry = {"key": key.hex(), "namespace": digest.hex() if digest else None, "problem": why,
                             "removed": bool(args.repair)}
                    bad.append(entry)
                    if not args.json:
                        progress.close()
                        print(f"bad  {key.hex()}  ns {digest.hex()[:16] if digest else '-':<16}  {why}"
                              f"{'  (removed)' if args.repair else ''}")
                progress.add(len(part))
        progress.close()
    summary = (f"checked {_plural(sum(counts[k] for k in ('good', 'manifest', 'bad', 'newer')), 'key')} of "
               f"store {opened.shown}: {counts['good']} good, {_plural(counts['manifest'], 'manifest')}, "
               f"{counts['bad']} bad")
    if counts["bad"]:
        summary += " (removed)" if args.repair else " (left in place; --repair removes them)"
    if counts["newer"]:
        summary += f", {counts['newer']} of a newer format"
    if args.json:
        print(json.dumps({"url": opened.shown, **counts, "bad_keys": bad,
                          "newer_format": [{"version": v, **u.to_dict()} for v, u in sorted(newer.items())]},
                         indent=2, sort_keys=True))
    else:
        print(summary)
    if counts["bad"] and not args.repair:
        return EXIT_PROBLEMS
    if newer:
        _error(_newer_message(opened.shown, newer))
        return EXIT_NEWER
    return EXIT_OK


# -- ucm store clear ---------------------------------------------------------------

def _looks_hex(text: str) -> bool:
    return len(text) >= 4 and set(text) <= _HEX


def resolve_namespaces(found: Survey, selectors: list[str], shown: str) -> list[bytes]:
    """The namespace digests a user's ``--namespace`` values name: a digest
    (or a prefix of 4+ hex digits of one), else a model name or model
    fingerprint prefix from the manifests (every rank of that model)."""
    chosen: list[bytes] = []
    known = found.digests()
    for selector in selectors:
        text = selector.strip()
        matched: list[bytes] = []
        if _looks_hex(text):
            matched = [d for d in known if d.hex().startswith(text.lower())]
            if len(matched) > 1:
                names = ", ".join(d.hex()[:16] for d in matched)
                raise UserError(f"namespace {text!r} is ambiguous in store '{shown}': it starts {names}; "
                                f"give more hex digits")
        if not matched:
            for digest in known:
                manifest = found.manifests.get(digest)
                if not manifest:
                    continue
                model = manifest.model_name or ""
                fingerprint = manifest.namespace.model_fingerprint
                if text and (text == model or text == os.path.basename(model.rstrip("/"))
                             or (len(text) >= 4 and fingerprint.startswith(text))):
                    matched.append(digest)
        if not matched:
            raise UserError(
                f"store '{shown}' has no namespace {text!r}; nothing was deleted. `ucm store stats {shown}` "
                f"lists its namespaces: give a digest prefix (4+ hex digits) or a model name")
        chosen += [d for d in matched if d not in chosen]
    return chosen


def _confirm(question: str, assume_yes: bool) -> bool:
    if assume_yes:
        return True
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    # Under cron or systemd (`<&-`) there is no stdin at all: sys.stdin is
    # None. That, an empty one and an unreadable one are all a "no".
    try:
        answer = sys.stdin.readline() if sys.stdin is not None else ""
    except (OSError, ValueError):
        answer = ""
    if not answer:
        sys.stderr.write("\nno answer: stdin is closed or empty (as under cron or systemd)\n")
        return False
    if not answer.endswith("\n"):
        sys.stderr.write("\n")
    return answer.strip().lower() in ("y", "yes")


def _delete(store: KVStore, keys: list[bytes], progress: Progress) -> int:
    for part in _chunks(keys, _DELETE_BATCH):
        store.delete(part)
        progress.add(len(part))
    progress.close()
    return len(keys)


def cmd_store_clear(args: argparse.Namespace) -> int:
    opened = open_for_cli(args.url)
    with opened.store as store:
        if not args.namespace:
            listing = _progress(args, "listing", store)
            keys: list[bytes] = []
            for batch in store.iter_keys(_LIST_BATCH):
                keys += batch
                listing.add(len(batch))
            listing.close()
            if not keys:
                print(f"store {opened.shown} is empty: nothing to delete")
                return EXIT_OK
            question = f"Delete all {_plural(len(keys), 'key')} (blocks and manifests) of store {opened.shown}?"
            what = f"{_plural(len(keys), 'key')}"
        else:
            found = survey(store, _progress(args, "reading headers", store), keep_keys=True)
            digests = resolve_namespaces(found, args.namespace, opened.shown)
            keys = []
            lines = []
            for digest in digests:
                usage = found.namespaces.get(digest, Usage())
                keys += usage.keys
                if digest in found.manifest_keys:
                    keys.append(found.manifest_keys[digest])
                manifest = found.manifests.get(digest)
                lines.append(f"  {digest.hex()[:16]}  {_plural(usage.num_blocks, 'block')}, "
                             f"{_nbytes(usage.nbytes)}  {describe(manifest) if manifest else '(no manifest)'}")
            num_blocks = sum(found.namespaces.get(d, Usage()).num_blocks for d in digests)
            print(f"store {opened.shown}: namespaces to clear:", file=sys.stderr)
            for line in lines:
                print(line, file=sys.stderr)
            question = f"Delete these {_plural(num_blocks, 'block')} and their manifests?"
            what = _plural(num_blocks, "block") + f" of {_plural(len(digests), 'namespace')}"
        if not _confirm(question, args.yes):
            _error("not confirmed; nothing was deleted (--yes deletes without asking)")
            return EXIT_PROBLEMS
        _delete(store, keys, _progress(args, "deleting"))
    print(f"deleted {what} from store {opened.shown}")
    return EXIT_OK


# -- ucm config check / reference -----------------------------------------------------

_ROLES = ("kv_both", "kv_producer", "kv_consumer")


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
        return True, f"reachable ({keys} keys, {_nbytes(stats.nbytes)} used)"
    except StoreError as exc:
        return False, str(exc)


def _check_disk_url(url: str, shown: str) -> tuple[bool, str]:
    path = _disk_path(url)
    if path is not None and is_disk_store(path):
        opened = open_for_cli(url)
        with opened.store as store:
            stats = store.stats()
        return True, f"a disk store with {stats.num_blocks} keys, {_nbytes(stats.nbytes)}"
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
    return True, (f"shm server running ({stats.num_blocks} blocks, {_nbytes(stats.nbytes)} of "
                  f"{_nbytes(stats.capacity_nbytes)})")


def cmd_config_check(args: argparse.Namespace) -> int:
    where, extra = _load_config_argument(args.config)
    try:
        config = UCMConfig.from_extra_config(extra)
    except UCMConfigError as exc:
        _error(f"invalid connector configuration: {exc}")
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
        return EXIT_OK
    status = EXIT_OK
    for url in config.store_urls:
        ok, line = check_store_url(url)
        if ok:
            print(f"store {mask_password(url)}: {line}")
        else:
            _error(line)
            status = EXIT_PROBLEMS
    return status


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
        "skips that):",
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


# -- ucm shm list / status / stop ------------------------------------------------------

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
        print(json.dumps({"runtime_dir": directory, "running": names}, indent=2))
        return EXIT_OK
    if not names:
        print(f"no shm server is running (runtime dir {directory})")
    for name in names:
        status = server_status(name, directory)
        if not status.answering:
            print(f"shm://{name}  (not answering)")
        else:
            print(f"shm://{name}  {_plural(status.num_blocks, 'block')}, {_nbytes(status.nbytes)} of "
                  f"{_nbytes(status.capacity_nbytes)}, pid {status.pid}")
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
        print(json.dumps(status.to_dict(), indent=2, sort_keys=True))
        return EXIT_OK
    capacity = status.capacity_nbytes
    used = status.used_nbytes
    print(f"shm://{name}: server pid {status.pid}, up {status.uptime_s / 3600:.1f} h")
    print(f"  {_plural(status.num_blocks, 'block')}, {_nbytes(status.nbytes)} of values in {_nbytes(used)} "
          f"of chunks; capacity {_nbytes(capacity)} ({100 * used / capacity:.1f}% used), "
          f"chunk {_nbytes(status.chunk_nbytes)}")
    print(f"  gets {status.gets}, hits {status.hits}, misses {status.misses}, "
          f"puts {status.puts}, put failures {status.put_failures}, "
          f"evictions {status.evictions}")
    print(f"  open write leases {status.num_leases} ({status.leased_chunks} chunks), "
          f"leases reclaimed {status.leases_reclaimed}, idle timeout "
          f"{'never' if status.idle_timeout_s is None else str(status.idle_timeout_s) + ' s'}")
    print(f"  segment {status.data_path}")
    return EXIT_OK


def cmd_shm_stop(args: argparse.Namespace) -> int:
    from store_backends import server_running, server_status, stop_server

    name = _shm_name(args.name)
    directory = _shm_runtime_dir(args.runtime_dir)
    if not server_running(name, directory):
        raise UserError(f"no shm server is running for {name!r} (runtime dir {directory}); nothing to stop")
    status = server_status(name, directory)
    held = (f" and its {_plural(status.num_blocks, 'block')} ({_nbytes(status.nbytes)})"
            if status.answering else "")
    if not _confirm(f"Stop the shm server of {name!r}{held}? Engines using shm://{name} lose those blocks.",
                    args.yes):
        _error("not confirmed; the server keeps running (--yes stops it without asking)")
        return EXIT_PROBLEMS
    try:
        stop_server(name, directory, timeout_s=args.timeout)
    except TimeoutError as exc:
        raise UserError(f"{exc}; its pid is in {status.pid_path}", EXIT_STORE) from None
    print(f"stopped the shm server of {name!r}")
    return EXIT_OK


def _add_shm_name(parser: argparse.ArgumentParser) -> None:
    # Optional for argparse only: _take_shm_name finds a NAME that starts
    # with '-', and says it is missing otherwise.
    parser.add_argument("name", metavar="NAME", nargs="?",
                        help="the store's NAME (shm://NAME); `-- NAME` if it is also one of the options")
    parser.set_defaults(shm_name_parser=parser)


def _take_shm_name(args: argparse.Namespace, extras: list[str]) -> list[str]:
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


# -- the command line ---------------------------------------------------------------------

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

  `ucm COMMAND SUBCOMMAND --help` describes each one's options.

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

    store = groups.add_parser("store", help="inspect, verify and clear a KV store",
                              description="Inspect, verify and clear a KV store given by its URL.",
                              formatter_class=_Formatter)
    store_cmds = store.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
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

    config = groups.add_parser("config", help="check a connector configuration; print the reference",
                               description="Check connector configurations; print the configuration reference.",
                               formatter_class=_Formatter)
    config_cmds = config.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    p = sub(config_cmds, "check", cmd_config_check, "validate a connector configuration",
            "Validate a connector configuration without starting vLLM, with the messages the\n"
            "connector gives at start-up. CONFIG is a YAML file of kv_connector_extra_config keys\n"
            "(what config_file names), a JSON string of kv_connector_extra_config, or a whole\n"
            "--kv-transfer-config JSON (or YAML file) with kv_connector_extra_config inside.\n"
            "Then each store is opened to see that the connector could use it (no shm:// server is\n"
            "started and no directory created); --no-connect skips that.",
            "  ucm config check /etc/ucm.yaml\n"
            "  ucm config check '{\"store\": [\"shm://ucm\", \"disk:///var/cache/ucm\"]}'\n"
            "  ucm config check \"$KV_TRANSFER_CONFIG\" --no-connect")
    p.add_argument("config", metavar="CONFIG", help="a YAML file or a JSON string")
    p.add_argument("--no-connect", action="store_true", help="do not open the stores")
    sub(config_cmds, "reference", cmd_config_reference, "print the configuration reference (Markdown)",
        "Print the reference of every connector option, rendered from the code's option table;\n"
        "docs/configuration.md is this output.",
        "  ucm config reference > docs/configuration.md")

    shm = groups.add_parser("shm", help="list, inspect and stop shm:// servers",
                            description="Manage the index servers of shm:// stores. Each shm://NAME store lives "
                                        "in a /dev/shm segment owned by one server process per NAME and host; "
                                        "its blocks last as long as the server.",
                            formatter_class=_Formatter)
    shm_cmds = shm.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if getattr(args, "shm_name_parser", None) is not None:
        extras = _take_shm_name(args, extras)
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if getattr(args, "batch", 1) < 1:
        parser.error("--batch must be at least 1")
    try:
        return args.func(args)
    except UserError as exc:
        _error(exc)
        return exc.status
    except StoreOpenError as exc:
        _error(exc)
        return EXIT_USAGE
    except StoreError as exc:
        _error(exc)
        return EXIT_STORE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        _error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `ucm ... | head`: the reader has gone; exit quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
