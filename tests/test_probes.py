"""Probes of vLLM internals are guarded like patches: a vLLM that differs
gets a clear PatchError, and the namespace falls back to one that only this
vLLM version shares."""

from __future__ import annotations

import pytest


def test_the_cpu_packing_probe_reads_vllms_answer():
    import torch

    from patches.probes import cpu_attention_isa

    assert cpu_attention_isa(torch.bfloat16, 128, 64, "auto") in ("vec", "vec16", "amx", "neon")


def test_a_probe_of_a_changed_function_says_what_differs(monkeypatch):
    from vllm.v1.attention.backends import cpu_attn

    from patches import PatchError
    from patches.probes import cpu_attention_isa

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda block_size, dtype: "vec")
    with pytest.raises(PatchError, match=r"_get_attn_isa has parameters \(block_size, dtype\)"):
        cpu_attention_isa(None, 128, 64, "auto")


def test_an_unknown_packing_gives_a_namespace_of_this_vllm_only(monkeypatch):
    from vllm.v1.attention.backends import cpu_attn

    from patches import vllm_version
    from ucm_connector.layout import kv_layout

    class _Cfg:
        class model_config:
            dtype = "bfloat16"

            @staticmethod
            def get_head_size():
                return 64

        class cache_config:
            block_size = 128
            cache_dtype = "auto"

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda: "vec")
    assert kv_layout(_Cfg) == f"cpu/CPU_ATTN/unknown-vllm-{vllm_version()}/auto"
