"""What a store holds, as the ``ucm store`` commands find it by walking its keys.

Owns opening a store for inspection (``open_for_cli``: ``OpenMode.INSPECT``,
the URL shown with its password masked), the header walk that ``store
stats`` and ``store clear --namespace`` share (``survey``: 64 bytes a key,
grouped by namespace, with the manifests that name the models), the check
of one whole stored value that ``store verify`` makes (``check_value``: a
``ValueCheck`` with its ``Verdict``), and the dataclasses that carry what
the commands found to ``output`` (``StatsReport``, ``VerifyReport``...).

Must not print, ask, or change a store: deleting is the commands' decision,
saying it is ``output``'s.  Uses only what ``store_backends`` exports.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterable

from store_backends import KVStore, OpenMode, Progress, StoreStats, mask_password, open_store

from .. import blockfmt
from ..manifest import (Manifest, ManifestError, NewerManifestError, describe, digest_of, is_manifest_key,
                        parse_manifest, read_manifests)

LIST_BATCH = 1000
HEAD_BATCH = 1000
DELETE_BATCH = 1000


def chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# -- opening stores --------------------------------------------------------------

@dataclasses.dataclass
class Opened:
    store: KVStore
    shown: str                       # the user's URL, password masked


def open_for_cli(url: str) -> Opened:
    """Open a store for inspection, without side effects beyond reading."""
    url = url.strip()
    return Opened(open_store(url, OpenMode.INSPECT), mask_password(url))


# -- the header walk -------------------------------------------------------------

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


class HeaderKind(enum.Enum):
    """What the first 64 bytes of a stored value say it is."""

    BLOCK = "block"          # a block this build reads
    NEWER = "newer"          # a block of a newer format version
    DAMAGED = "damaged"      # a UCM block whose header is wrong
    FOREIGN = "foreign"      # not a UCM block at all


@dataclasses.dataclass(frozen=True)
class HeaderClass:
    kind: HeaderKind
    namespace_digest: bytes | None = None    # for BLOCK
    version: int | None = None               # for NEWER


def classify_header(size: int, head: bytes) -> HeaderClass:
    """What a value of ``size`` bytes starting with ``head`` (its first 64
    bytes) is."""
    try:
        header = blockfmt.parse_header(head)
    except blockfmt.UnsupportedVersionError as exc:
        if exc.version > blockfmt.FORMAT_VERSION:
            return HeaderClass(HeaderKind.NEWER, version=exc.version)
        return HeaderClass(HeaderKind.DAMAGED)
    except blockfmt.BadMagicError:
        return HeaderClass(HeaderKind.FOREIGN)
    except blockfmt.BlockFormatError:
        return HeaderClass(HeaderKind.DAMAGED)
    if size != blockfmt.block_nbytes(header.payload_nbytes):
        return HeaderClass(HeaderKind.DAMAGED)
    return HeaderClass(HeaderKind.BLOCK, namespace_digest=header.namespace_digest)


def survey(store: KVStore, progress: Progress, keep_keys: bool = False) -> Survey:
    """Read every key's header (64 bytes each, not whole blocks) and when it
    was last used, grouped by namespace."""
    found = Survey()
    for keys in store.iter_keys(LIST_BATCH):
        found.num_keys += len(keys)
        blocks = []
        for key in keys:
            if is_manifest_key(key):
                found.manifest_keys[digest_of(key)] = key
            else:
                blocks.append(key)
        for part in chunks(blocks, HEAD_BATCH):
            # Times first: on Redis before 7.2 reading a value resets its idle time.
            times = store.last_used(part)
            heads = store.peek(part, blockfmt.HEADER_NBYTES)
            for key, head, when in zip(part, heads, times):
                if head is None:
                    continue  # gone since it was listed
                what = classify_header(*head)
                if what.kind is HeaderKind.BLOCK:
                    usage = found.namespaces.setdefault(what.namespace_digest, Usage())
                elif what.kind is HeaderKind.NEWER:
                    usage = found.newer.setdefault(what.version, Usage())
                else:
                    usage = found.damaged if what.kind is HeaderKind.DAMAGED else found.foreign
                usage.add(key, head[0], when, keep_keys)
        progress.advance(len(keys))
    progress.close()
    for digest, manifest in read_manifests(store, found.digests()).items():
        if isinstance(manifest, Manifest):
            found.manifests[digest] = manifest
        elif not isinstance(manifest, NewerManifestError):
            found.bad_manifests[digest] = manifest
    return found


# -- ucm store stats: what the survey says, per namespace --------------------------------

@dataclasses.dataclass
class NamespaceRow:
    """One namespace of ``store stats``: its blocks, and the model its
    manifest names."""

    digest: bytes
    usage: Usage
    manifest: Manifest | None
    bad_manifest: ManifestError | None

    @property
    def description(self) -> str | None:
        return describe(self.manifest) if self.manifest else None

    def to_dict(self) -> dict:
        return {
            "digest": self.digest.hex(),
            **self.usage.to_dict(),
            "manifest": self.manifest.to_dict() if self.manifest else None,
            "description": self.description,
            "bad_manifest": str(self.bad_manifest) if self.bad_manifest else None,
        }


def namespace_rows(found: Survey) -> list[NamespaceRow]:
    """The namespaces to show, largest first."""
    rows = []
    for digest in found.digests():
        usage = found.namespaces.get(digest, Usage())
        manifest = found.manifests.get(digest)
        if not usage.num_blocks and manifest is None:
            continue  # only a manifest that cannot be read: no namespace to show
        rows.append(NamespaceRow(digest, usage, manifest, found.bad_manifests.get(digest)))
    rows.sort(key=lambda r: (-r.usage.nbytes, r.digest.hex()))
    return rows


@dataclasses.dataclass
class StatsReport:
    """What ``ucm store stats`` found: the survey and the store's own figures."""

    shown: str
    found: Survey
    stats: StoreStats
    rows: list[NamespaceRow]

    @property
    def num_blocks(self) -> int:
        return sum(u.num_blocks for u in self.found.namespaces.values())

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.found.namespaces.values())


# -- ucm store verify: one whole value at a time ------------------------------------------

class Verdict(enum.Enum):
    """What ``store verify`` makes of one stored value."""

    GOOD = "good"            # a block whose envelope and checksum are right
    MANIFEST = "manifest"    # a namespace's manifest this build reads (or a newer build's)
    BAD = "bad"              # damaged: --repair removes it
    NEWER = "newer"          # a block of a newer format: never removed


@dataclasses.dataclass(frozen=True)
class ValueCheck:
    verdict: Verdict
    problem: str = ""                        # what is wrong, for BAD
    namespace_digest: bytes | None = None
    version: int | None = None               # the format version, for NEWER


def check_value(key: bytes, value: bytes) -> ValueCheck:
    """Check one stored value whole: a manifest's fields, or a block's
    envelope, checksum and the key it was written for."""
    if is_manifest_key(key):
        try:
            parse_manifest(value, digest_of(key))
        except NewerManifestError:
            pass  # a newer build's: not damage, never removed
        except ManifestError as exc:
            return ValueCheck(Verdict.BAD, f"bad manifest: {exc}", digest_of(key))
        return ValueCheck(Verdict.MANIFEST, "", digest_of(key))
    try:
        header = blockfmt.parse_header(value)
    except blockfmt.UnsupportedVersionError as exc:
        if exc.version > blockfmt.FORMAT_VERSION:
            return ValueCheck(Verdict.NEWER, str(exc), version=exc.version)
        return ValueCheck(Verdict.BAD, str(exc))
    except blockfmt.BlockFormatError as exc:
        return ValueCheck(Verdict.BAD, str(exc))
    try:
        blockfmt.verify(value, header.namespace_digest, key=key)
    except blockfmt.BlockFormatError as exc:
        return ValueCheck(Verdict.BAD, str(exc), header.namespace_digest)
    return ValueCheck(Verdict.GOOD, "", header.namespace_digest)


@dataclasses.dataclass
class VerifyCounts:
    """How many values ``store verify`` found of each verdict, and removed."""

    good: int = 0
    manifest: int = 0
    bad: int = 0
    newer: int = 0
    removed: int = 0

    def add(self, verdict: Verdict) -> None:
        setattr(self, verdict.value, getattr(self, verdict.value) + 1)

    @property
    def checked(self) -> int:
        return self.good + self.manifest + self.bad + self.newer

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BadEntry:
    """One damaged value: its key, namespace (where known) and what is wrong."""

    key: bytes
    namespace_digest: bytes | None
    problem: str
    removed: bool

    def to_dict(self) -> dict:
        return {"key": self.key.hex(), "namespace": self.namespace_digest.hex() if self.namespace_digest else None,
                "problem": self.problem, "removed": self.removed}


@dataclasses.dataclass
class VerifyReport:
    """What ``ucm store verify`` found in the whole store."""

    shown: str
    repair: bool
    counts: VerifyCounts = dataclasses.field(default_factory=VerifyCounts)
    bad: list[BadEntry] = dataclasses.field(default_factory=list)
    newer: dict[int, Usage] = dataclasses.field(default_factory=dict)
