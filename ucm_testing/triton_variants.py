"""Every variant of block_topk's Triton kernels that the tests launch,
compiled for a CUDA GPU on a machine without one.

Triton's CPU interpreter (``TRITON_INTERPRET=1``) runs the kernels' Python,
not their compilation: a kernel that the interpreter runs but Triton's
compiler rejects would fail at its first launch on a GPU.  So:

* ``record(path)``: while active, each launch through ``triton_select``
  appends the kernel's name, its argument types and its compile-time
  constants to ``path`` (JSON lines), and runs as usual;
* ``python -m ucm_testing.triton_variants PATH [--arch 90]`` (without
  ``TRITON_INTERPRET``) compiles each distinct variant down to a cubin for
  that architecture with the ptxas Triton ships, and exits non-zero naming
  every variant that does not compile.

``make test-kernels`` does both.  What this cannot tell: speed, and
whether the compiled code computes what the interpreter did.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

#: The launchers of ``ucm_connector.sparse.triton_select`` and their kernels.
LAUNCHERS = {"_fold_launch": "_fold_decode_kernel", "_logits_launch": "_block_logits_kernel",
             "_select_launch": "_select_kernel", "_reuse_launch": "_reuse_kernel"}

def specialization(kernel_name: str, args) -> list:
    """Each positional argument's type and what Triton specialises on, as
    its launcher works them out on a GPU: ``[type, attribute]``, where an
    int equal to 1 becomes ``["constexpr", 1]`` and the attribute "D" marks
    a pointer or int divisible by 16; the ints named in
    ``triton_select.RUNTIME_INTS`` are not specialised, nor the pointers in
    ``RUNTIME_POINTERS`` on their alignment."""
    import inspect

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from ucm_connector.sparse import triton_select

    kernel = getattr(triton_select, kernel_name)
    params = list(inspect.signature(kernel.fn).parameters)
    ints, pointers = set(triton_select.RUNTIME_INTS[kernel_name]), set(triton_select.RUNTIME_POINTERS[kernel_name])
    out = []
    for name, value in zip(params, args):
        kind, attr = native_specialize_impl(BaseBackend, value, False, name not in ints, name not in pointers)
        out.append([kind, attr])
    return out


@contextlib.contextmanager
def record(path: str):
    """Append every kernel launch's variant to ``path`` while active."""
    from ucm_connector.sparse import triton_select

    originals = {name: getattr(triton_select, name) for name in LAUNCHERS}

    def recording(name, launch):
        def at(grid):
            launcher = launch(grid)

            def run(*args, **kwargs):
                options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
                constants = {k: v for k, v in kwargs.items() if k not in options}
                kernel = LAUNCHERS[name]
                with open(path, "a") as f:
                    f.write(json.dumps({"kernel": kernel, "specialization": specialization(kernel, args),
                                        "constants": constants, "options": options}) + "\n")
                return launcher(*args, **kwargs)
            return run
        return at

    for name, launch in originals.items():
        setattr(triton_select, name, recording(name, launch))
    try:
        yield
    finally:
        for name, launch in originals.items():
            setattr(triton_select, name, launch)


def variants(path: str) -> list[dict]:
    seen, out = set(), []
    with open(path) as f:
        for line in f:
            variant = json.loads(line)
            key = json.dumps(variant, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(variant)
    return out


def compile_variant(variant: dict, arch: int) -> float:
    """Compile one variant to a cubin; the seconds it took."""
    import inspect

    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    from ucm_connector.sparse import triton_select

    kernel = getattr(triton_select, variant["kernel"])
    params = list(inspect.signature(kernel.fn).parameters)
    signature, constexprs, attrs = {}, dict(variant["constants"]), {}
    for i, (name, (kind, attr)) in enumerate(zip(params, variant["specialization"])):
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    for name in variant["constants"]:
        signature[name] = "constexpr"
    t0 = time.perf_counter()
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options=variant["options"])
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the variants recorded by record() (JSON lines)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, as 90 for sm_90 (H100)")
    args = parser.parse_args(argv)
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET: the interpreter compiles nothing")
    found = variants(args.path)
    if not found:
        print(f"no variants recorded in {args.path}", file=sys.stderr)
        return 1
    failed = []
    seconds = 0.0
    for variant in found:
        try:
            seconds += compile_variant(variant, args.arch)
        except Exception as exc:  # every variant is tried; each failure is named
            failed.append(f"{variant['kernel']} {variant['constants']}: {type(exc).__name__}: {exc}")
    by_kernel: dict[str, int] = {}
    for variant in found:
        by_kernel[variant["kernel"]] = by_kernel.get(variant["kernel"], 0) + 1
    print(f"compiled {len(found) - len(failed)} of {len(found)} kernel variants for sm_{args.arch} in "
          f"{seconds:.1f} s ({', '.join(f'{k} {n}' for k, n in sorted(by_kernel.items()))})")
    for line in failed:
        print("FAILED " + line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
