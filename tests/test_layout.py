"""The KV layout in the namespace: engines share blocks exactly when their
pages hold the same bytes for the same KV."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ucm_connector.cache_views import LAYOUTS
from ucm_connector.layout import kv_layout, namespace_for, page_order


def test_layouts_that_order_a_page_alike_name_one_page_order():
    assert {page_order(name) for name in ("LBNHC", "BLNHC")} == {"page=NHC"}
    assert {page_order(name) for name in ("LBHNC", "LHBNC", "BLHNC", "BHLNC")} == {"page=HNC"}
    assert {page_order(name) for name in LAYOUTS} == {"page=NHC", "page=HNC"}


def test_vllm_aliases_and_unknown_layouts():
    assert page_order("NHD") == page_order("LBNHC")
    assert page_order("hnd") == page_order("LBHNC")
    assert page_order("LBXYZ") == "layout=LBXYZ"     # kept apart from every known one
    assert page_order(None) == "default"


def _gpu_config(layout: str | None):
    model = SimpleNamespace(model="org/some-model", dtype="torch.bfloat16", get_head_size=lambda: 128,
                            get_num_layers=lambda parallel: 32, get_num_kv_heads=lambda parallel: 8)
    return SimpleNamespace(model_config=model,
                           cache_config=SimpleNamespace(kv_cache_layout=layout, cache_dtype="auto", block_size=16),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           attention_config=SimpleNamespace(backend="FLASH_ATTN"))


@pytest.fixture
def on_a_gpu(monkeypatch):
    platforms = pytest.importorskip("vllm.platforms")
    monkeypatch.setattr(platforms, "current_platform", SimpleNamespace(is_cpu=lambda: False, device_name="cuda"),
                        raising=False)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def test_the_resolved_layout_reaches_the_namespace(on_a_gpu):
    assert kv_layout(_gpu_config("LBNHC")) == "cuda/FLASH_ATTN/page=NHC/auto"
    assert kv_layout(_gpu_config("LBHNC")) == "cuda/FLASH_ATTN/page=HNC/auto"
    digest = {name: namespace_for(_gpu_config(name)).digest for name in LAYOUTS}
    assert digest["LBNHC"] == digest["BLNHC"]
    assert digest["LBNHC"] != digest["LBHNC"]
    assert len(set(digest.values())) == 2


def test_a_layout_forced_by_the_environment_counts_when_none_is_recorded(on_a_gpu, monkeypatch):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    assert kv_layout(_gpu_config(None)) == "cuda/FLASH_ATTN/page=HNC/auto"
    assert kv_layout(_gpu_config("LBNHC")) == "cuda/FLASH_ATTN/page=NHC/auto"   # the recorded one wins


def test_a_drafter_with_kv_of_its_own_gets_its_own_namespace(on_a_gpu):
    """EAGLE, MTP and draft models register their layers' caches with the
    model's, so their engines store bigger blocks: sharing a namespace with
    an engine without them, each would delete the other's blocks as the
    wrong size.  Drafters without KV (n-gram, suffix, Medusa) share."""
    def with_spec(method, draft=None):
        config = _gpu_config("LBNHC")
        config.speculative_config = None if method is None else SimpleNamespace(
            method=method, draft_model_config=None if draft is None else SimpleNamespace(model=draft))
        return namespace_for(config).digest

    plain = with_spec(None)
    assert with_spec("ngram") == with_spec("suffix") == with_spec("medusa") == plain
    eagle, other_eagle, mtp = with_spec("eagle3", "org/eagle-a"), with_spec("eagle3", "org/eagle-b"), with_spec("mtp")
    assert len({plain, eagle, other_eagle, mtp}) == 4
    assert with_spec("eagle3", "org/eagle-a") == eagle


def test_a_sparse_method_gets_its_own_namespace_per_option(on_a_gpu):
    config = _gpu_config("LBNHC")
    dense = namespace_for(config)
    a = namespace_for(config, sparse={"method": "block_topk", "budget_blocks": 3})
    same = namespace_for(config, sparse={"budget_blocks": 3, "method": "block_topk"})
    other = namespace_for(config, sparse={"method": "block_topk", "budget_blocks": 4})
    assert a.digest == same.digest
    assert len({dense.digest, a.digest, other.digest}) == 3
    assert dict(a.extra) == {"sparse": '{"budget_blocks":3,"method":"block_topk"}'}
    assert "sparse=" in a.describe() and namespace_for(config, sparse=None).digest == dense.digest


def test_what_changes_the_kv_beyond_the_models_files_gets_its_own_namespace(on_a_gpu):
    """A quantization applied at load time and --hf-overrides change every
    layer's KV with the same files; a hub name's revision names other
    files.  At their defaults the namespace is what it always was."""
    def digest(**settings):
        config = _gpu_config("LBNHC")
        config.model_config.__dict__.update(settings)
        return namespace_for(config)

    plain = digest()
    assert plain.extra == () and digest(quantization=None, hf_overrides={}, revision=None).digest == plain.digest

    def rope(config):
        return config

    variants = [digest(quantization="fp8"), digest(hf_overrides={"rope_theta": 1e6}),
                digest(hf_overrides={"rope_theta": 2e6}), digest(hf_overrides=rope), digest(revision="v2")]
    assert len({plain.digest} | {v.digest for v in variants}) == 6
    assert digest(hf_overrides={"b": 1, "a": 2}).digest == digest(hf_overrides={"a": 2, "b": 1}).digest
    assert dict(variants[0].extra) == {"quantization": "fp8"}


def test_ucm_explain_names_a_model_as_the_connector_does_revision_included():
    import os

    from ucm_connector.explain_prompt import model_identity
    from ucm_connector.layout import _fingerprint

    for revision in (None, "v2"):
        assert model_identity("org/some-model", revision) == _fingerprint("org/some-model", revision)
    assert model_identity("org/some-model", "v2") != model_identity("org/some-model")
    local = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tiny-llama")
    if os.path.isdir(local):               # a local directory is known by its files alone
        assert model_identity(local, "v2") == model_identity(local) == _fingerprint(local, "v2")
