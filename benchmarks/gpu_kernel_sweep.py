"""The scoring kernel of ``block_topk`` on CUDA (``triton_select``'s
``_block_logits_kernel``) at other block positions per program and warps:
device time of the kernel and of a whole selection call, and whether the
blocks chosen stay those of the first setting.  CUDA, torch and Triton
only (no vLLM); the workload is ``gpu_sparse_bench.py``'s.

    python benchmarks/gpu_kernel_sweep.py [--context 32768] [--configs 32,4 8,1 ...]
        [--score bound] [--channels 32]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_sparse_bench as bench  # noqa: E402

from ucm_connector.sparse import triton_select  # noqa: E402
from ucm_connector.sparse.block_topk import BlockTopK, BlockTopKOptions  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--configs", nargs="+", default=["32,4", "32,2", "16,1", "8,1"],
                   help="positions per program,warps (the first is the baseline)")
    p.add_argument("--score", choices=["mean", "bound"], default="mean", help="block_topk's score option")
    p.add_argument("--channels", type=int, help="block_topk's channels option")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernel_sweep needs CUDA", file=sys.stderr)
        return 2
    shapes = bench.Shapes(rows=8, keep_ratio=0.25, channels=args.channels)
    options = {"keep_ratio": shapes.keep_ratio, "dense_below": 0, "score": args.score}
    if args.channels is not None:
        options["channels"] = args.channels
    work = bench.Workload(shapes, args.context, 4, "cuda")
    score_and_select, launch_logits = triton_select.score_and_select, triton_select._logits_launch
    base = None
    print(f"{torch.cuda.get_device_name()}; {shapes}; score {args.score}; context {args.context}")
    try:
        for config in args.configs:
            tile, warps = (int(x) for x in config.split(","))

            def launch(grid, _warps=warps):
                kernel = launch_logits(grid)
                return lambda *a, **kw: kernel(*a, **{**kw, "num_warps": _warps})

            triton_select._logits_launch = launch
            triton_select.score_and_select = functools.partial(score_and_select, tile=tile)
            t0 = time.perf_counter()
            step = bench.Stepper(work, BlockTopK(BlockTopKOptions.parse(options), kernels="triton"))
            for _ in range(2):          # compiles this setting's variants
                step()
            torch.cuda.synchronize()
            timed = bench._per_layer(step, args.steps)
            launched = bench._kernels(step)
            kernels = ({k: round(v / bench.LAYERS_PER_STEP, 1) for k, v in launched[1].items()}
                       if launched else None)
            table = step().block_table.clone()
            same = "-" if base is None else ("yes" if torch.equal(table, base) else "NO")
            base = table if base is None else base
            graph = timed.get("graph_ms")
            print(f"positions {tile:3d}, warps {warps}: selection graph "
                  f"{'-' if graph is None else f'{1e3 * graph:.1f}'} us; kernels (us per layer call) {kernels}; "
                  f"same blocks: {same} ({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        triton_select.score_and_select, triton_select._logits_launch = score_and_select, launch_logits
    return 0


if __name__ == "__main__":
    sys.exit(main())
