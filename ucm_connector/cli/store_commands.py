"""``ucm store stats|verify|clear``: what a KV store holds, whether it is sound, emptying it.

Owns the three store commands: what each reads, what it deletes (``verify
--repair`` only the bad values, ``clear`` only after a yes), how
``--namespace`` selectors name namespaces, and each command's exit status.

Must not print reports itself (``output`` says what was found), walk a
store in its own way (``survey`` owns the walks and the checks), or open a
store otherwise than through ``survey.open_for_cli``: every store command
is an inspection first, with ``OpenMode.INSPECT``.
"""

from __future__ import annotations

import argparse
import os
import string
import sys

from store_backends import KVStore, Progress

from ..manifest import describe
from .output import (EXIT_NEWER, EXIT_OK, EXIT_PROBLEMS, UserError, bad_entry_line, confirm, error, nbytes,
                     newer_message, plural, print_stats_json, print_stats_text, print_verify_json, progress,
                     verify_summary)
from .survey import (DELETE_BATCH, LIST_BATCH, BadEntry, StatsReport, Survey, Usage, Verdict, VerifyReport,
                     check_value, chunks, namespace_rows, open_for_cli, survey)

_HEX = set(string.hexdigits)


# -- ucm store stats ---------------------------------------------------------------

def cmd_store_stats(args: argparse.Namespace) -> int:
    opened = open_for_cli(args.url)
    with opened.store as store:
        found = survey(store, progress(args, "stats", store))
        stats = store.stats()
    report = StatsReport(opened.shown, found, stats, namespace_rows(found))
    if args.json:
        print_stats_json(report)
    else:
        print_stats_text(report)
    if found.newer:
        error(newer_message(opened.shown, found.newer))
        return EXIT_NEWER
    return EXIT_OK


# -- ucm store verify --------------------------------------------------------------

def cmd_store_verify(args: argparse.Namespace) -> int:
    opened = open_for_cli(args.url)
    report = VerifyReport(opened.shown, repair=bool(args.repair))
    counts = report.counts
    with opened.store as store:
        bar = progress(args, "verify", store)
        for keys in store.iter_keys(LIST_BATCH):
            for part in chunks(keys, args.batch):
                problems: list[BadEntry] = []
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
                    check = check_value(key, got[1])
                    counts.add(check.verdict)
                    if check.verdict is Verdict.BAD:
                        problems.append(BadEntry(key, check.namespace_digest, check.problem, report.repair))
                    elif check.verdict is Verdict.NEWER:
                        report.newer.setdefault(check.version, Usage()).add(key, got[0], None, False)
                if unread:
                    # Listed but unreadable: a damaged entry, unless it was
                    # removed or evicted in between.
                    for key, present in zip(unread, store.contains(unread)):
                        if present:
                            counts.add(Verdict.BAD)
                            problems.append(BadEntry(
                                key, None, "unreadable: the store holds the key but cannot read its value",
                                report.repair))
                if problems and args.repair:
                    store.delete([entry.key for entry in problems])
                    counts.removed += len(problems)
                for entry in problems:
                    report.bad.append(entry)
                    if not args.json:
                        bar.close()
                        print(bad_entry_line(entry))
                bar.advance(len(part))
        bar.close()
    if args.json:
        print_verify_json(report)
    else:
        print(verify_summary(report))
    if counts.bad and not args.repair:
        return EXIT_PROBLEMS
    if report.newer:
        error(newer_message(opened.shown, report.newer))
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


def _delete(store: KVStore, keys: list[bytes], bar: Progress) -> int:
    for part in chunks(keys, DELETE_BATCH):
        store.delete(part)
        bar.advance(len(part))
    bar.close()
    return len(keys)


def cmd_store_clear(args: argparse.Namespace) -> int:
    opened = open_for_cli(args.url)
    with opened.store as store:
        if not args.namespace:
            listing = progress(args, "listing", store)
            keys: list[bytes] = []
            for batch in store.iter_keys(LIST_BATCH):
                keys += batch
                listing.advance(len(batch))
            listing.close()
            if not keys:
                print(f"store {opened.shown} is empty: nothing to delete")
                return EXIT_OK
            question = f"Delete all {plural(len(keys), 'key')} (blocks and manifests) of store {opened.shown}?"
            what = f"{plural(len(keys), 'key')}"
        else:
            found = survey(store, progress(args, "reading headers", store), keep_keys=True)
            digests = resolve_namespaces(found, args.namespace, opened.shown)
            keys = []
            lines = []
            for digest in digests:
                usage = found.namespaces.get(digest, Usage())
                keys += usage.keys
                if digest in found.manifest_keys:
                    keys.append(found.manifest_keys[digest])
                manifest = found.manifests.get(digest)
                lines.append(f"  {digest.hex()[:16]}  {plural(usage.num_blocks, 'block')}, "
                             f"{nbytes(usage.nbytes)}  {describe(manifest) if manifest else '(no manifest)'}")
            num_blocks = sum(found.namespaces.get(d, Usage()).num_blocks for d in digests)
            print(f"store {opened.shown}: namespaces to clear:", file=sys.stderr)
            for line in lines:
                print(line, file=sys.stderr)
            question = f"Delete these {plural(num_blocks, 'block')} and their manifests?"
            what = plural(num_blocks, "block") + f" of {plural(len(digests), 'namespace')}"
        if not confirm(question, args.yes):
            error("not confirmed; nothing was deleted (--yes deletes without asking)")
            return EXIT_PROBLEMS
        _delete(store, keys, progress(args, "deleting"))
    print(f"deleted {what} from store {opened.shown}")
    return EXIT_OK
