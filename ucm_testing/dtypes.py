"""The dtype the test engines compute in.

vLLM's users run bf16, and the tests do too on a CPU that multiplies bf16
natively (AVX512-BF16 or AMX).  On a CPU without (AVX2 alone) torch's bf16
matmuls take a slow path: on a 2-core AVX2 EPYC, SmolLM2-135M prefilled
1,000 tokens in 25.3 s in bf16 and in 4.35 s in float32, and
``tests/test_loadpolicy_e2e.py`` took 12.6 min in bf16 and 4.0 min in
float32.  So there the engines run in float32: the connector's paths are the
same for every dtype, and the unit tests of pages, transfers and checksums
cover bf16 on every CPU.

``UCM_TEST_DTYPE=bfloat16`` (or ``float32``) forces one on any CPU.
"""

from __future__ import annotations

import functools
import os

ENV = "UCM_TEST_DTYPE"
DTYPES = ("bfloat16", "float32")


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """Whether torch multiplies bf16 natively on this CPU."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def engine_dtype() -> str:
    """The dtype of the test engines: ``UCM_TEST_DTYPE`` when set, else
    bfloat16 on a CPU that multiplies it natively and float32 elsewhere."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in DTYPES:
            raise ValueError(f"{ENV}={forced!r}: expected one of {', '.join(DTYPES)}")
        return forced
    return "bfloat16" if cpu_multiplies_bf16() else "float32"


def other_dtype() -> str:
    """The dtype a test gives an engine that must not share the others' KV."""
    return DTYPES[1 - DTYPES.index(engine_dtype())]
