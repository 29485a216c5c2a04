"""KV block transfer speed on a CUDA machine, against raw pinned copies.

Runs with torch alone (no vLLM): the caches are built the way vLLM builds
them (``ucm_connector.cache_views``).  For each layout it measures, within
one run, ``BlockTransfer.gather_rows`` (pages -> pinned host rows, the save
path) and ``scatter_rows`` (pinned rows -> pages, the load path) on a batch
of blocks, and raw pinned copies of the same number of bytes between one
contiguous device buffer and the same pinned rows; it checks byte for byte
that the rows hold each block's pages (expected bytes from the caches'
logical views) and that a scatter changes exactly the target pages.  Then
the design options behind the defaults (staging size, pipelining, one index
operation vs one per layer, the copy-at-return API, per-block DMA with a
block-outermost layout), whether a gather sees compute-stream writes queued
just before it, and the sparse-attention section when its module exists.

    python3 benchmarks/gpu_bench.py                  # Llama-3-8B shapes, 128-block batches
    python3 benchmarks/gpu_bench.py --json out.json  # also the figures as JSON
    python3 benchmarks/gpu_bench.py --device cpu --layers 4 --num-blocks 64 --blocks 8   # smoke test

Figures are medians of ``--reps`` interleaved repetitions, host wall time
from the call to the data being there (what the connector waits for).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ucm_connector.cache_views import (LAYOUTS, PAGE_ORDER, block_major_caches, fill_random_,  # noqa: E402
                                       kv_first_caches, mla_caches, vllm_layer_caches)
from ucm_connector.transfer import BlockTransfer  # noqa: E402

HEADER = 64   # a stored block's header sits in front of the payload in each row


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device, reps, warmup=2):
    times = []
    for i in range(warmup + reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


class Case:
    """One cache layout: how to build it and what a block's payload is."""

    def __init__(self, name, build, expected_page, block_dim=0):
        self.name = name
        self.build = build                   # (num_blocks, device) -> (backing tensors, caches)
        self.expected_page = expected_page   # (cache tensor, block) -> uint8 bytes of the stored page
        self.block_dim = block_dim           # where the cache tensors index blocks


def _cases(args):
    L, H, N, D = args.layers, args.kv_heads, args.block_size, args.head_size
    dtype = torch.bfloat16
    cases = []
    for layout in LAYOUTS:
        def build(num_blocks, device, layout=layout):
            raw, caches = vllm_layer_caches(layout, num_layers=L, num_blocks=num_blocks, num_heads=H,
                                            block_size=N, content_nbytes=2 * D * 2, dtype=dtype, device=device)
            return [raw], caches

        order = PAGE_ORDER[layout]

        def page(view, b, order=order):
            p = view[b]
            return (p.permute(1, 0, 2) if order == "NHC" else p).contiguous().view(torch.uint8).reshape(-1)
        label = f"vllm {layout}" + (" (default: FlashAttention)" if layout == "LBNHC" else "")
        cases.append(Case(label, build, page))

    def kv_first(num_blocks, device):
        caches = kv_first_caches(num_layers=L, num_blocks=num_blocks, num_heads=H, block_size=N, head_size=D,
                                 dtype=dtype, device=device)
        return list(caches.values()), caches
    cases.append(Case("K/V-first [2,B,N,H,D] (FlashAttention, older)", kv_first,
                      lambda t, b: torch.cat([t[0, b].reshape(-1), t[1, b].reshape(-1)]).view(torch.uint8),
                      block_dim=1))

    def block_major(num_blocks, device):
        caches = block_major_caches(num_layers=L, num_blocks=num_blocks, num_heads=H, block_size=N, head_size=D,
                                    dtype=dtype, device=device)
        return list(caches.values()), caches
    cases.append(Case("block-major [B,2,N,H,D] (FlashInfer, older)", block_major,
                      lambda t, b: t[b].reshape(-1).view(torch.uint8)))

    def mla(num_blocks, device):
        # DeepSeek-style latent: 512 + 64 bf16 per token, FlashMLA's 64-token blocks.
        caches = mla_caches(num_layers=L, num_blocks=num_blocks, block_size=64, latent=576, dtype=dtype,
                            device=device)
        return list(caches.values()), caches
    cases.append(Case("MLA block-major [B,64,576]", mla, lambda t, b: t[b].reshape(-1).view(torch.uint8)))
    return cases


def _expected_rows(case, caches, block_ids):
    return torch.stack([torch.cat([case.expected_page(t, b) for t in caches.values()]) for b in block_ids])


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.results = {"layouts": [], "options": [], "checks": {}}
        rng = np.random.default_rng(0)
        perm = rng.permutation(args.num_blocks)
        self.src_ids = [int(b) for b in perm[:args.blocks]]
        self.dst_ids = [int(b) for b in perm[args.blocks:2 * args.blocks]]

    # -- raw copies ----------------------------------------------------------

    def _raw(self, rows, dev_buf):
        """Raw copies of the rows' bytes: device -> pinned rows, pinned rows -> device."""
        if self.device.type != "cuda":
            host = rows.rows

            def d2h():
                np.copyto(host, dev_buf)

            def h2d():
                np.copyto(dev_buf, host)
            return d2h, h2d

        def d2h():
            rows.tensor.copy_(dev_buf, non_blocking=True)
            torch.cuda.synchronize(self.device)

        def h2d():
            dev_buf.copy_(rows.tensor, non_blocking=True)
            torch.cuda.synchronize(self.device)
        return d2h, h2d

    def _measure(self, transfer, rows, dev_buf, reps=None, gather=None, scatter=None):
        """Median seconds of gather, scatter, raw D2H, raw H2D, interleaved."""
        reps = reps or self.args.reps
        d2h, h2d = self._raw(rows, dev_buf)
        gather = gather or (lambda: transfer.gather_rows(self.src_ids, rows).wait())
        scatter = scatter or (lambda: transfer.scatter_rows(self.dst_ids, rows).synchronize())
        ops = {"gather": gather, "raw_d2h": d2h, "scatter": scatter, "raw_h2d": h2d}
        times = {k: [] for k in ops}
        for i in range(2 + reps):
            for k, fn in ops.items():
                _sync(self.device)
                t0 = time.perf_counter()
                fn()
                if i >= 2:
                    times[k].append(time.perf_counter() - t0)
        return {k: statistics.median(v) for k, v in times.items()}

    def _figures(self, name, t, payload_nbytes, row_nbytes, extra=None):
        n = self.args.blocks
        payload, raw = n * payload_nbytes, n * row_nbytes
        fig = {"name": name,
               "gather_GBps": payload / t["gather"] / 1e9, "scatter_GBps": payload / t["scatter"] / 1e9,
               "raw_d2h_GBps": raw / t["raw_d2h"] / 1e9, "raw_h2d_GBps": raw / t["raw_h2d"] / 1e9}
        fig["gather_ratio"] = fig["gather_GBps"] / fig["raw_d2h_GBps"]
        fig["scatter_ratio"] = fig["scatter_GBps"] / fig["raw_h2d_GBps"]
        fig.update(extra or {})
        return fig

    # -- one layout ----------------------------------------------------------

    def layout(self, case):
        args, dev = self.args, self.device
        backing, caches = case.build(args.num_blocks, dev)
        for i, t in enumerate(backing):
            fill_random_({}, t, seed=i + 1)
        transfer = BlockTransfer(caches, args.num_blocks, staging_nbytes=args.staging_mib << 20)
        row_nbytes = HEADER + transfer.payload_nbytes
        pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=args.blocks * row_nbytes)
        rows = pool.take(args.blocks)
        if dev.type == "cuda" and not self.results.get("host_rows"):
            self.results["host_rows"] = ("numpy memory registered with cudaHostRegister" if pool.registered
                                         else "torch pinned allocation")
            print(f"(host rows: {self.results['host_rows']}, pinned: {rows.tensor.is_pinned()})", flush=True)
        dev_buf = (torch.empty(args.blocks, row_nbytes, dtype=torch.uint8, device=dev) if dev.type == "cuda"
                   else np.zeros((args.blocks, row_nbytes), dtype=np.uint8))

        # Byte-exact: rows hold the pages; a scatter changes exactly the target pages.
        transfer.gather_rows(self.src_ids, rows).wait()
        want = _expected_rows(case, caches, self.src_ids).cpu().numpy()
        gather_exact = bool(np.array_equal(rows.rows[:, HEADER:], want))
        before = [t.clone() for t in backing]
        transfer.scatter_rows(self.dst_ids, rows).synchronize()
        after = [t.clone() for t in backing]
        for t, b in zip(backing, before):
            t.copy_(b)
        for name, view in caches.items():     # the expected change, through the logical views
            if case.block_dim == 1:
                view[:, self.dst_ids] = view[:, self.src_ids]
            else:
                view[self.dst_ids] = view[self.src_ids]
        # Compared as bytes: random bf16 bytes hold NaNs, which never compare equal.
        scatter_exact = all(torch.equal(a.view(torch.uint8), t.view(torch.uint8)) for a, t in zip(after, backing))
        del before, after

        t = self._measure(transfer, rows, dev_buf)
        fig = self._figures(case.name, t, transfer.payload_nbytes, row_nbytes,
                            {"payload_MiB_per_block": transfer.payload_nbytes / 2**20,
                             "index_ops_per_chunk": transfer.num_segments,
                             "pinned": bool(rows.tensor.is_pinned()) if dev.type == "cuda" else False,
                             "gather_exact": gather_exact, "scatter_exact": scatter_exact})
        self.results["layouts"].append(fig)
        self._print_layout(fig)
        return backing, caches, transfer, pool, rows, dev_buf

    def _print_layout(self, f):
        print(f"{f['name']:<46} {f['gather_GBps']:6.1f} {f['gather_ratio']:5.2f}x  "
              f"{f['scatter_GBps']:6.1f} {f['scatter_ratio']:5.2f}x  raw {f['raw_d2h_GBps']:5.1f}/"
              f"{f['raw_h2d_GBps']:5.1f}  ops {f['index_ops_per_chunk']}  exact "
              f"{'yes' if f['gather_exact'] and f['scatter_exact'] else 'NO'}", flush=True)

    # -- design options ------------------------------------------------------

    def _variants(self, case, variants):
        """Each BlockTransfer setting of ``variants`` on one cache of ``case``."""
        args, dev = self.args, self.device
        backing, caches = case.build(args.num_blocks, dev)
        for i, t in enumerate(backing):
            fill_random_({}, t, seed=i + 1)
        base = BlockTransfer(caches, args.num_blocks, staging_nbytes=args.staging_mib << 20)
        row_nbytes = HEADER + base.payload_nbytes
        pool = base.row_pool(row_nbytes, HEADER, max_nbytes=args.blocks * row_nbytes)
        rows = pool.take(args.blocks)
        dev_buf = torch.empty(args.blocks, row_nbytes, dtype=torch.uint8, device=dev)
        print(f"\nDesign options on {case.name}, {args.blocks}-block batches "
              "(gather GB/s, ratio; scatter GB/s, ratio; compute stream held after a gather):")
        for label, kw in variants:
            kw = dict(kw)
            in_place = kw.pop("in_place", True)
            transfer = BlockTransfer(caches, args.num_blocks, **kw)
            transfer._gather_in_place = transfer._scatter_in_place = in_place
            held = self._held(transfer, rows)
            t = self._measure(transfer, rows, dev_buf)
            fig = self._figures(f"{case.name.split(' (')[0]}: {label}", t, transfer.payload_nbytes, row_nbytes,
                                {"held_ms": held})
            self.results["options"].append(fig)
            print(f"  {label:<44} {fig['gather_GBps']:6.1f} {fig['gather_ratio']:5.2f}x  "
                  f"{fig['scatter_GBps']:6.1f} {fig['scatter_ratio']:5.2f}x  held {held:5.2f} ms", flush=True)
            del transfer
        return backing, caches, base, pool, rows, dev_buf, row_nbytes

    def options(self):
        """The choices behind the defaults."""
        args, dev = self.args, self.device
        mib = args.staging_mib
        cases = _cases(args)
        kv_first = next(c for c in cases if c.name.startswith("K/V-first"))
        backing, caches, base, pool, rows, dev_buf, row_nbytes = self._variants(kv_first, [
            (f"staging {mib} MiB, 2 slots (default)", dict(staging_nbytes=mib << 20)),
            (f"staging {mib} MiB, 4 slots", dict(staging_nbytes=mib << 20, slots=4)),
            ("staging 512 MiB, 2 slots", dict(staging_nbytes=512 << 20)),
        ])
        pool.close()
        del backing, caches, base, pool, rows
        torch.cuda.empty_cache()
        case = cases[0]     # vllm LBNHC
        backing, caches, base, pool, rows, dev_buf, row_nbytes = self._variants(case, [
            (f"staging {mib} MiB, 2 slots (default)", dict(staging_nbytes=mib << 20)),
            (f"staging {mib} MiB, 4 slots", dict(staging_nbytes=mib << 20, slots=4)),
            (f"staging {mib} MiB, 1 slot (no overlap)", dict(staging_nbytes=mib << 20, slots=1)),
            ("staging 32 MiB, 2 slots", dict(staging_nbytes=32 << 20)),
            ("staging 512 MiB, 2 slots", dict(staging_nbytes=512 << 20)),
            ("one index op per layer", dict(staging_nbytes=mib << 20, merge_layers=False)),
            ("index ops through a contiguous temporary", dict(staging_nbytes=mib << 20, in_place=False)),
        ])

        # The copy-at-return API over pageable numpy buffers (one host memcpy more).
        pageable = np.zeros((args.blocks, base.payload_nbytes), dtype=np.uint8)
        t = self._measure(base, rows, dev_buf, gather=lambda: base.gather(self.src_ids, pageable),
                          scatter=lambda: base.scatter(self.dst_ids, pageable))
        fig = self._figures("gather()/scatter() into pageable numpy", t, base.payload_nbytes, row_nbytes)
        self.results["options"].append(fig)
        print(f"  {fig['name']:<44} {fig['gather_GBps']:6.1f} {fig['gather_ratio']:5.2f}x  "
              f"{fig['scatter_GBps']:6.1f} {fig['scatter_ratio']:5.2f}x", flush=True)
        del backing, caches, base
        torch.cuda.empty_cache()

        # Block-outermost layout: one DMA per block straight between the
        # cache and the pinned row, no staging, no kernel.
        case = next(c for c in _cases(args) if c.name.startswith("vllm BLNHC"))
        backing, caches = case.build(args.num_blocks, dev)
        raw = backing[0]
        per_block = raw.numel() // args.num_blocks
        blocks_view = raw.view(torch.uint8).view(args.num_blocks, per_block)
        side = torch.cuda.Stream(device=dev)

        def direct_gather():
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for i, b in enumerate(self.src_ids):
                    rows.tensor[i, HEADER:].copy_(blocks_view[b], non_blocking=True)
            side.synchronize()

        def direct_scatter():
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for i, b in enumerate(self.dst_ids):
                    blocks_view[b].copy_(rows.tensor[i, HEADER:], non_blocking=True)
            side.synchronize()
        t = self._measure(None, rows, dev_buf, gather=direct_gather, scatter=direct_scatter)
        fig = self._figures("BLNHC: one DMA per block, no staging", t, per_block, row_nbytes)
        self.results["options"].append(fig)
        print(f"  {fig['name']:<44} {fig['gather_GBps']:6.1f} {fig['gather_ratio']:5.2f}x  "
              f"{fig['scatter_GBps']:6.1f} {fig['scatter_ratio']:5.2f}x", flush=True)
        del backing, caches, blocks_view, raw
        torch.cuda.empty_cache()

        if args.big_cache_gib:
            # A cache past 2^31 words: torch's index kernels switch to 64-bit offsets.
            num_blocks = int((args.big_cache_gib << 30) // row_nbytes)
            case = _cases(args)[0]
            backing, caches = case.build(num_blocks, dev)
            transfer = BlockTransfer(caches, num_blocks, staging_nbytes=args.staging_mib << 20)
            far = [num_blocks - 1 - i for i in range(args.blocks)]
            t = self._measure(transfer, rows, dev_buf, gather=lambda: transfer.gather_rows(far, rows).wait(),
                              scatter=lambda: transfer.scatter_rows(far, rows).synchronize())
            label = f"LBNHC cache of {args.big_cache_gib} GiB (64-bit offsets)"
            fig = self._figures(label, t, transfer.payload_nbytes, row_nbytes)
            self.results["options"].append(fig)
            print(f"  {label:<44} {fig['gather_GBps']:6.1f} {fig['gather_ratio']:5.2f}x  "
                  f"{fig['scatter_GBps']:6.1f} {fig['scatter_ratio']:5.2f}x", flush=True)
            del backing, caches, transfer
            torch.cuda.empty_cache()
        pool.close()

    def _held(self, transfer, rows):
        """How long kernels queued right after a gather wait for it (ms)."""
        dev = self.device
        compute = torch.cuda.current_stream(dev)
        vals = []
        for _ in range(3):
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(compute)
            t = transfer.gather_rows(self.src_ids, rows)
            end.record(compute)
            t.wait()
            end.synchronize()
            vals.append(start.elapsed_time(end))
        return statistics.median(vals)

    # -- ordering --------------------------------------------------------------

    def ordering(self):
        args, dev = self.args, self.device
        case = _cases(args)[0]
        backing, caches = case.build(args.num_blocks, dev)
        transfer = BlockTransfer(caches, args.num_blocks, staging_nbytes=args.staging_mib << 20)
        row_nbytes = HEADER + transfer.payload_nbytes
        pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=args.blocks * row_nbytes)
        rows = pool.take(args.blocks)
        block = self.src_ids[-1]
        torch.cuda._sleep(50_000_000)                # the compute stream is busy ...
        for view in caches.values():
            view[block].view(torch.uint8).fill_(0x5A)   # ... then writes a page
        transfer.gather_rows([block], rows).wait()
        seen = bool((rows.rows[0, HEADER:] == 0x5A).all())
        rows.rows[:, HEADER:] = 0x3C
        transfer.scatter_rows(self.dst_ids, rows)     # returns before the upload is done
        pages = [view[self.dst_ids[-1]].view(torch.uint8).clone() for view in caches.values()]
        loaded = all(bool((p == 0x3C).all()) for p in pages)
        self.results["checks"] = {"gather_sees_compute_writes": seen, "compute_reads_loaded_pages": loaded}
        print(f"\nA gather right after compute-stream writes to its pages sees them: {'yes' if seen else 'NO'}")
        print(f"Kernels queued right after a scatter read the loaded pages:       {'yes' if loaded else 'NO'}")
        pool.close()
        del backing, caches
        torch.cuda.empty_cache()


# --- sparse attention section: benchmarks/gpu_sparse_bench.py, owned by the
# sparse-attention work; called here when the module exists, so that one run
# prints both.  --no-sparse skips it; --sparse-args passes it arguments.
def run_sparse_section(argv: list[str]) -> None:
    path = Path(__file__).with_name("gpu_sparse_bench.py")
    print("\n== Sparse attention (benchmarks/gpu_sparse_bench.py) ==", flush=True)
    if not path.exists():
        print("not present in this checkout; skipped")
        return
    spec = importlib.util.spec_from_file_location("gpu_sparse_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048, help="blocks in each cache (2 MiB each by default)")
    p.add_argument("--blocks", type=int, default=128, help="blocks per batch")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--staging-mib", type=int, default=128)
    p.add_argument("--big-cache-gib", type=int, default=20, help="0 skips the large-cache run")
    p.add_argument("--layouts", default="", help="comma-separated name prefixes (default: all)")
    p.add_argument("--no-options", action="store_true")
    p.add_argument("--no-sparse", action="store_true")
    p.add_argument("--sparse-args", default="")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; use --device cpu for a smoke test")
        return 2
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}; {args.layers} layers, {args.kv_heads} KV heads, head "
          f"{args.head_size}, {args.block_size}-token blocks, bf16; batches of {args.blocks} blocks; "
          f"staging {args.staging_mib} MiB per direction", flush=True)
    bench = Bench(args)
    bench.results["gpu"] = gpu
    bench.results["torch"] = torch.__version__
    bench.results["args"] = vars(args)
    print(f"\n{'layout':<46} {'gather':>6} {'/raw':>6}  {'scatter':>6} {'/raw':>6}  raw D2H/H2D GB/s", flush=True)
    for case in _cases(args):
        if args.layouts and not any(x in case.name for x in args.layouts.split(",")):
            continue
        backing, caches, transfer, pool, rows, dev_buf = bench.layout(case)
        pool.close()
        del backing, caches, transfer, pool, rows, dev_buf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if dev.type == "cuda":
        if not args.no_options:
            bench.options()
        bench.ordering()
    # The transfer figures are written, and judged, before the sparse
    # section runs: a failure there must not lose them.
    if args.json:
        Path(args.json).write_text(json.dumps(bench.results, indent=1))
    failed = [f["name"] for f in bench.results["layouts"] if not (f["gather_exact"] and f["scatter_exact"])]
    failed += [k for k, v in bench.results["checks"].items() if not v]
    if failed:
        print("FAILED: " + "; ".join(failed), flush=True)
    if not args.no_sparse:
        try:
            run_sparse_section(args.sparse_args.split())
        except Exception:
            traceback.print_exc()
            print("FAILED: the sparse section (above); the transfer figures stand", flush=True)
            return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
