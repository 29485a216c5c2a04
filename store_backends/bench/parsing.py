"""The ``ucm-bench`` command line: its options, help text and checks.

Owns ``build_parser`` (the options, their types and limits, the help that
explains each raw medium), and ``store_urls``: the ``--store`` values as a
list of URLs (several, or a JSON list, make a tier).  Must not open a store
or run anything.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Sequence

ALL_OPS = ("put", "get", "contains", "prefix_len")
DEFAULT_OPS = "put,get,contains,prefix_len"

_DESCRIPTION = """\
Benchmark a KV-cache store: throughput (GB/s, blocks/s) and latency
percentiles of put, get (get_into preallocated buffers), contains and
prefix_len, and -- in the same run, with the same block size, block count,
batch size and threads -- the raw medium the store sits on:

  shm://                      memcpy between the buffers and a /dev/shm region
  disk:///DIR                 plain open/write/close and open/readinto/close,
                              one file per block, in a temporary subdirectory of DIR
  redis://, rediss://, unix://  plain redis-py pipelined SET and MGET on the same
                              server and db, under a separate key prefix
  redis-cluster://            plain redis-py RedisCluster pipeline SET and mget_nonatomic
  a tier or another scheme    no raw baseline (shown as n/a)

The raw Redis get is MGET alone: its values come back as bytes and are not
copied into the buffers, so the store/raw ratio of get charges a Redis store
for that copy.  The memcpy and file baselines do fill the same buffers.
Buffers and values are page-aligned, as a caller's pinned buffers are.

Every block read back is compared with what was put; a miss or a wrong byte
is reported with its key and block and makes the exit status 1.

Timing: one or more untimed warm-up rounds (--warmup), then --repeat timed
rounds; throughput is the median of the rounds (the best is in the JSON),
latency percentiles are taken over every call of the timed rounds.  Each
round puts --blocks fresh keys (so no put is short-circuited by an existing
key), reads them back, asks for them, and deletes them.  Store and raw
alternate which goes first from round to round.  GB/s means 10^9 bytes/s.

Exit status: 0 ok, 1 verification failure (or the store failed mid-run),
2 bad arguments, the store could not be opened, or --json could not be
written; 130 interrupted (Ctrl-C), after removing what the run wrote."""

_EPILOG = """\
examples:
  ucm-bench --store 'shm://bench?capacity=1GiB' --block-kib 1024 --blocks 256
  ucm-bench --store disk:///var/tmp/ucm-bench --threads 2 --json disk.json
  ucm-bench --store redis://:secret@127.0.0.1:6379/0 --batch 32
  ucm-bench --store unix:///run/redis/redis.sock
  ucm-bench --store redis-cluster://10.0.0.1:7000,10.0.0.2:7000
  ucm-bench --store shm://ucm --store disk:///var/tmp/ucm      (a tier, fastest first)
  ucm-bench --store disk:///var/tmp/ucm --block-kib 4 --blocks 8192 --ops contains,prefix_len
                                      (the lookup target: prefix_len on 8,192 keys)"""


class UsageError(Exception):
    """Bad arguments found after parsing; exit status 2."""


def _whole_number(minimum: int, rule: str) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``; ``rule``
    says what the smaller ones break."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} {rule}")
        return value

    return parse


_positive_int = _whole_number(1, "must be at least 1")
_non_negative_int = _whole_number(0, "must not be negative")


def _ops(text: str) -> list[str]:
    ops = [op.strip() for op in text.split(",") if op.strip()]
    unknown = [op for op in ops if op not in ALL_OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(
            f"unknown op(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(ALL_OPS)}")
    return [op for op in ALL_OPS if op in ops]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ucm-bench", description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", action="append", required=True, metavar="URL",
                        help="store URL; give it several times (or a JSON list) for a tier, fastest first")
    parser.add_argument("--block-kib", type=_positive_int, default=1024, metavar="N",
                        help="block size in KiB (default 1024)")
    parser.add_argument("--blocks", type=_positive_int, default=256, metavar="N",
                        help="distinct blocks per round (default 256)")
    parser.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                        help="worker threads, each with its own slice of the keys (default 1)")
    parser.add_argument("--batch", type=_positive_int, default=16, metavar="N",
                        help="keys per store call (default 16)")
    parser.add_argument("--ops", type=_ops, default=_ops(DEFAULT_OPS), metavar="LIST",
                        help=f"comma-separated ops to time, from {','.join(ALL_OPS)} (default all); "
                             "blocks are always put, untimed if put is not listed")
    parser.add_argument("--repeat", type=_positive_int, default=3, metavar="N",
                        help="timed rounds; throughput is their median (default 3)")
    parser.add_argument("--warmup", type=_non_negative_int, default=1, metavar="N",
                        help="untimed warm-up rounds before the timed ones (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the block values (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH ('-' = stdout)")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw-medium baseline")
    parser.add_argument("--keep", action="store_true",
                        help="leave the last round's blocks in the store (their key prefix is printed)")
    parser.add_argument("--progress", action="store_true",
                        help="show the progress bar even when stderr is not a terminal")
    parser.add_argument("--quiet", action="store_true",
                        help="print nothing but errors and verification failures (use with --json)")
    return parser


def store_urls(values: Sequence[str]) -> list[str]:
    urls: list[str] = []
    for value in values:
        text = value.strip()
        if text.startswith("["):
            try:
                listed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise UsageError(f"--store {text!r} starts with '[' but is not a JSON list: {exc}") from None
            if not isinstance(listed, list) or not all(isinstance(u, str) for u in listed):
                raise UsageError(f"--store {text!r}: a JSON list of URL strings was expected")
            urls.extend(listed)
        else:
            urls.append(text)
    if not urls:
        raise UsageError("--store names no store")
    return urls
