"""Block hashing speed: ucm-connector's keys against vLLM's own block hashes,
on the same tokens in one run; and the cost of the block checksum.

    .venv/bin/python benchmarks/hash_bench.py [--tokens 131072] [--json out.json]

vLLM is timed the way its scheduler hashes a request: one
``hash_block_tokens(hash_fn, parent, block_tokens, None)`` call per full
block, chained, for each built-in hash function. That leaves out vLLM's
per-block extra-key bookkeeping, so the ratios shown are, if anything, in
vLLM's favour. Both sides start from the request's token list (a Python list,
as vLLM holds it). Without vLLM installed, only our numbers are printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm_connector import blockfmt  # noqa: E402
from ucm_connector.hashing import BlockHasher, Namespace  # noqa: E402

VLLM_ALGOS = ("sha256", "xxhash", "sha256_cbor", "xxhash_cbor")


def best_ms(fn, repeat: int, number: int = 1) -> float:
    """Best time of one call, over ``repeat`` runs of ``number`` calls, with
    the garbage collector paused so neither side pays for the other's garbage."""
    fn()  # warm caches and lazy imports
    best = float("inf")
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(number):
                fn()
            best = min(best, (time.perf_counter() - start) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return best * 1e3


def load_vllm():
    """vLLM's hash functions, or the reason they cannot be used."""
    # A fixed seed makes vLLM's first-block hash deterministic and silences its
    # warning for the CBOR functions; it does not change the per-block work.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    try:
        import vllm
        from vllm.v1.core import kv_cache_utils
        try:
            from vllm.utils.hashing import get_hash_fn_by_name
        except ImportError:
            from vllm.utils import get_hash_fn_by_name
    except Exception as exc:  # any failure just means: no vLLM column
        return None, f"vLLM not importable ({type(exc).__name__}: {exc})"
    return (vllm.__version__, kv_cache_utils, get_hash_fn_by_name), None


def vllm_hash_all(kv_cache_utils, hash_fn, token_ids, block_size):
    hash_block_tokens = kv_cache_utils.hash_block_tokens
    parent = None
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + block_size], None)
        hashes.append(parent)
    return hashes


def time_vllm_request_hasher(kv_cache_utils, hash_fn, token_ids, block_size, repeat):
    """vLLM's own per-request hasher (extra-key bookkeeping included) on a
    real ``Request``, or None where this vLLM's Request cannot be built so."""
    try:
        from vllm import SamplingParams
        from vllm.v1.request import Request
        hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
        request = Request(request_id="bench", prompt_token_ids=token_ids,
                          sampling_params=SamplingParams(max_tokens=1), pooling_params=None)
        assert len(hasher(request)) == len(token_ids) // block_size
    except Exception:
        return None
    return best_ms(lambda: hasher(request), repeat)


def time_hashing(token_ids, block_sizes, repeat):
    vllm_parts, vllm_missing = load_vllm()
    rows = []
    for block_size in block_sizes:
        namespace = Namespace("0" * 32, "bfloat16", "CPU_ATTN/vec", block_size, 30, 3, 64)
        hasher = BlockHasher(namespace)
        num_blocks = len(token_ids) // block_size
        assert len(hasher.block_keys(token_ids)) == num_blocks
        row = {"block_size": block_size, "num_blocks": num_blocks,
               "ucm_ms": best_ms(lambda: hasher.block_keys(token_ids), repeat),
               "ucm_request_ms": best_ms(lambda: hasher.request().update(token_ids), repeat),
               "vllm_ms": {}}
        if vllm_parts is not None:
            _, kv_cache_utils, get_hash_fn_by_name = vllm_parts
            for algo in VLLM_ALGOS:
                try:
                    hash_fn = get_hash_fn_by_name(algo)
                except Exception:
                    continue
                kv_cache_utils.init_none_hash(hash_fn)
                hashes = vllm_hash_all(kv_cache_utils, hash_fn, token_ids, block_size)
                assert len(hashes) == num_blocks
                row["vllm_ms"][algo] = best_ms(
                    lambda: vllm_hash_all(kv_cache_utils, hash_fn, token_ids, block_size), repeat)
                request_ms = time_vllm_request_hasher(kv_cache_utils, hash_fn, token_ids,
                                                      block_size, repeat)
                if request_ms is not None:
                    row.setdefault("vllm_request_hasher_ms", {})[algo] = request_ms
        rows.append(row)
    version = vllm_parts[0] if vllm_parts else None
    return rows, version, vllm_missing


def time_checksums(sizes_mib, repeat):
    namespace = bytes(16)
    rows = []
    for mib in sizes_mib:
        nbytes = mib << 20
        block = bytearray(blockfmt.block_nbytes(nbytes))
        block[blockfmt.HEADER_NBYTES:] = np.random.default_rng(mib).integers(
            0, 256, nbytes, dtype=np.uint8).tobytes()
        payload = memoryview(block)[blockfmt.HEADER_NBYTES:]
        row = {"payload_mib": mib}
        for name, fn in (("xxh3_64", lambda: xxhash.xxh3_64_intdigest(payload)),
                         ("xxh3_128", lambda: xxhash.xxh3_128_digest(payload)),
                         ("pack_into", lambda: blockfmt.pack_into(block, namespace, nbytes)),
                         ("verify", lambda: blockfmt.verify(block, namespace, nbytes))):
            ms = best_ms(fn, repeat, number=20)
            row[name] = {"ms": ms, "gb_per_s": nbytes / (ms / 1e3) / 1e9}
        mv = memoryview(block)
        row["memcpy"] = {"ms": best_ms(lambda: bytearray(mv), repeat, number=20)}
        row["memcpy"]["gb_per_s"] = nbytes / (row["memcpy"]["ms"] / 1e3) / 1e9
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=131072, help="prompt length (default 131072)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--repeat", type=int, default=20, help="timed runs; the best is kept")
    parser.add_argument("--checksum-mib", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    token_ids = np.random.default_rng(0).integers(0, 128_000, args.tokens).tolist()
    rows, vllm_version, vllm_missing = time_hashing(token_ids, args.block_sizes, args.repeat)

    print(f"Block hashing, {args.tokens:,} tokens, best of {args.repeat} "
          f"(python {platform.python_version()}, {platform.machine()}, "
          f"vLLM {vllm_version or 'absent'})")
    if vllm_missing:
        print(f"  {vllm_missing}: timing ucm only")
    algos = [a for a in VLLM_ALGOS if any(a in r["vllm_ms"] for r in rows)]
    header = f"{'block':>6} {'blocks':>7} {'ucm ms':>8} {'ucm req':>8}"
    header += "".join(f" {a + ' ms':>15} {'ratio':>6}" for a in algos)
    print(header)
    for r in rows:
        line = (f"{r['block_size']:>6} {r['num_blocks']:>7} {r['ucm_ms']:>8.2f} "
                f"{r['ucm_request_ms']:>8.2f}")
        for a in algos:
            ms = r["vllm_ms"].get(a)
            line += f" {ms:>15.2f} {ms / r['ucm_ms']:>5.1f}x" if ms else f" {'-':>15} {'-':>6}"
        print(line)
    for r in rows:
        for algo, ms in r.get("vllm_request_hasher_ms", {}).items():
            print(f"  vLLM's request hasher ({algo}, block {r['block_size']}): {ms:.2f} ms, "
                  f"{ms / r['ucm_ms']:.1f}x ucm")
    print("  ratio = vLLM time / ucm time (higher is better for ucm); "
          "'ucm req' = a fresh RequestKeys.update on the same list")

    checksum_rows = time_checksums(args.checksum_mib, args.repeat)
    print("\nBlock checksum and envelope, GB/s of payload (best of %d)" % args.repeat)
    cols = ("xxh3_64", "xxh3_128", "pack_into", "verify", "memcpy")
    print(f"{'MiB':>5}" + "".join(f" {c:>10}" for c in cols))
    for r in checksum_rows:
        print(f"{r['payload_mib']:>5}" + "".join(f" {r[c]['gb_per_s']:>10.1f}" for c in cols))

    if args.json:
        result = {"tokens": args.tokens, "repeat": args.repeat, "vllm_version": vllm_version,
                  "vllm_missing": vllm_missing, "python": platform.python_version(),
                  "machine": platform.machine(), "hashing": rows, "checksum": checksum_rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
