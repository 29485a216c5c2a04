"""The KV layout in the namespace: engines share blocks exactly when their
pages hold the same bytes for the same KV."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
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


# -- settings that change the KV of the same files ---------------------------------

def _model_dir(path, **config) -> str:
    """A tiny model directory (config.json and one small weights file)."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    base = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 128,
            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 1000, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32", "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False}
    base.update(config)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(base, f)
    save_file({"model.embed_tokens.weight": torch.zeros(1000, 128)}, os.path.join(path, "model.safetensors"))
    return str(path)


def _engine_namespace(model: str, **args):
    from vllm.engine.arg_utils import EngineArgs

    return namespace_for(EngineArgs(model=model, dtype="float32", **args).create_engine_config())


LONGROPE = {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16}}


def test_a_longrope_model_is_kept_apart_by_max_model_len(tmp_path):
    """Phi-3's LongRoPE rotates every position with its long factors when
    max_model_len passes the original context (4096 here), with its short
    ones otherwise: the same prompt has other keys' KV at 4096 and 16384."""
    model = _model_dir(tmp_path / "phi3", **LONGROPE)
    short, long_ = _engine_namespace(model, max_model_len=4096), _engine_namespace(model, max_model_len=16384)
    assert short.digest != long_.digest
    assert dict(short.extra)["max_model_len"] == "4096"
    plain = _model_dir(tmp_path / "plain")
    assert _engine_namespace(plain, max_model_len=4096).digest == _engine_namespace(plain, max_model_len=16384).digest
    assert _engine_namespace(plain, max_model_len=4096).extra == ()


def test_dummy_weights_are_kept_apart_from_the_files_weights(tmp_path):
    model = _model_dir(tmp_path / "m")
    files, dummy = _engine_namespace(model, max_model_len=1024), _engine_namespace(
        model, max_model_len=1024, load_format="dummy")
    assert files.digest != dummy.digest and dict(dummy.extra) == {"load_format": "dummy"}
    assert _engine_namespace(model, max_model_len=1024, load_format="safetensors").digest == files.digest


def test_the_layers_left_unquantized_are_in_the_namespace(on_a_gpu):
    def digest(skipped):
        config = _gpu_config("LBNHC")
        config.cache_config.kv_cache_dtype_skip_layers = skipped
        return namespace_for(config).digest

    assert digest([]) == namespace_for(_gpu_config("LBNHC")).digest
    assert len({digest([]), digest(["0"]), digest(["1"]), digest(["sliding_window"])}) == 4
    assert digest(["0", "2"]) == digest(["2", "0"])


def test_a_config_read_from_elsewhere_is_in_the_namespace(tmp_path):
    """--hf-config-path: vLLM runs with that config, not the model's
    config.json (which alone is in the fingerprint)."""
    import shutil

    model = _model_dir(tmp_path / "m")
    other = tmp_path / "other-config"
    other.mkdir()
    _model_dir(tmp_path / "tmp", rope_theta=500000.0)
    shutil.copy(tmp_path / "tmp" / "config.json", other / "config.json")
    same = tmp_path / "same-config"
    same.mkdir()
    shutil.copy(tmp_path / "m" / "config.json", same / "config.json")
    own = _engine_namespace(model, max_model_len=1024)
    theta = _engine_namespace(model, max_model_len=1024, hf_config_path=str(other))
    alike = _engine_namespace(model, max_model_len=1024, hf_config_path=str(same))
    assert theta.digest != own.digest and alike.digest != theta.digest
    assert dict(theta.extra)["hf_config"] != dict(alike.extra)["hf_config"]


def test_two_override_functions_that_do_different_things_are_told_apart(tmp_path):
    model = _model_dir(tmp_path / "m")

    def make(theta):
        def override(config):
            config.rope_theta = theta
            return config
        return override

    a = _engine_namespace(model, max_model_len=1024, hf_overrides=make(1e5))
    b = _engine_namespace(model, max_model_len=1024, hf_overrides=make(1e6))
    again = _engine_namespace(model, max_model_len=1024, hf_overrides=make(1e5))
    assert a.digest != b.digest and a.digest == again.digest


def test_mistral_params_are_in_the_fingerprint(tmp_path):
    import json

    from ucm_connector.hashing import model_fingerprint

    model = _model_dir(tmp_path / "m")
    before = model_fingerprint(model)
    with open(tmp_path / "m" / "params.json", "w") as f:
        json.dump({"dim": 128, "rope_theta": 1e6}, f)
    with_params = model_fingerprint(model)
    with open(tmp_path / "m" / "params.json", "w") as f:
        json.dump({"dim": 128, "rope_theta": 1e7}, f)
    assert len({before, with_params, model_fingerprint(model)}) == 3


def test_a_hub_name_is_known_by_the_commit_of_its_cached_snapshot(tmp_path, monkeypatch):
    """One name, two snapshots (a model republished, or two hosts' caches):
    two models.  With nothing cached the name and revision are all there is."""
    from huggingface_hub import constants

    from ucm_connector.hashing import name_fingerprint

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    uncached = name_fingerprint("org/model")
    repo = tmp_path / "models--org--model"

    def snapshot(commit):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)

    snapshot("a" * 40)
    first = name_fingerprint("org/model")
    assert first == name_fingerprint("org/model", "a" * 40) != uncached
    snapshot("b" * 40)
    assert name_fingerprint("org/model") == name_fingerprint("org/model", "main") != first
    assert name_fingerprint("org/model", "a" * 40) == first


# A stand-in for ModelScope's client (its hub cannot be reached from here):
# snapshot_download as vLLM and the connector call it, over a cache laid out
# as ModelScope lays out its own (CACHE/models/ORG--NAME/snapshots/REVISION).
_MODELSCOPE_CLIENT = """
import os
calls = []

def snapshot_download(model_id=None, revision=None, cache_dir=None, local_files_only=False, **kwargs):
    calls.append(dict(model_id=model_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only))
    if not local_files_only:
        raise RuntimeError("no network here")
    path = os.path.join(cache_dir or os.environ["FAKE_MODELSCOPE_CACHE"], "models", model_id.replace("/", "--"),
                        "snapshots", revision or "master")
    if not os.path.isdir(path) or not os.listdir(path):
        raise FileNotFoundError("Cannot find cached snapshot for model repo " + model_id)
    return path
"""


def test_a_modelscope_name_is_known_by_the_weight_files_of_its_local_copy(tmp_path, monkeypatch):
    """With VLLM_USE_MODELSCOPE, vLLM takes a name from ModelScope, whose
    snapshot directory is named "master", not by a commit, and whose next
    download of a republished model replaces the files: the connector knows
    such a model by the weight files of its copy in ModelScope's cache
    (where vLLM's loader puts them), so it shares blocks with an engine that
    loads the same files from a directory.  A copy without weights (a
    tokenizer's or a quantization config's download) and no copy at all
    give the name, never the config alone (two fine-tunes share one) nor
    Hugging Face's commit for the same name.  ModelScope is asked without
    the network, and ``ucm explain`` names the model alike."""
    import shutil
    import sys

    import torch
    from safetensors.torch import save_file

    from ucm_connector import layout
    from ucm_connector.explain_prompt import model_identity as explain_identity
    from ucm_connector.hashing import MODELSCOPE, model_fingerprint, model_identity, name_fingerprint

    package = tmp_path / "site" / "modelscope" / "hub"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "snapshot_download.py").write_text(_MODELSCOPE_CLIENT)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("modelscope", "modelscope.hub", "modelscope.hub.snapshot_download"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")       # what the connector and ucm explain read
    monkeypatch.setenv("FAKE_MODELSCOPE_CACHE", str(tmp_path / "cache"))
    layout._fingerprint.cache_clear()
    config = SimpleNamespace(model="org/model", revision=None, model_weights="")
    by_name = name_fingerprint("org/model", None, MODELSCOPE)

    assert layout._identity(config) == by_name != name_fingerprint("org/model")

    snapshot = tmp_path / "cache" / "models" / "org--model" / "snapshots" / "master"
    _model_dir(snapshot)
    weights = snapshot / "model.safetensors"
    os.rename(weights, tmp_path / "weights")            # a copy with the config alone
    assert model_identity("org/model", hub=MODELSCOPE) == by_name

    os.rename(tmp_path / "weights", weights)
    layout._fingerprint.cache_clear()
    with_weights = layout._identity(config)
    local_copy = shutil.copytree(snapshot, tmp_path / "elsewhere")
    assert with_weights == model_fingerprint(snapshot) == model_identity(str(local_copy)) != by_name
    assert explain_identity("org/model") == with_weights

    save_file({"model.embed_tokens.weight": torch.ones(1000, 128)}, str(weights))     # republished
    assert model_identity("org/model", hub=MODELSCOPE) != with_weights

    calls = sys.modules["modelscope.hub.snapshot_download"].calls
    assert calls and all(call["local_files_only"] and call["cache_dir"] is None for call in calls)
    layout._fingerprint.cache_clear()


def _mixed_engine(tmp_path, heads=(1, 2, 1, 2)):
    """A real engine config, and vLLM's own KV cache config and caches for a
    model whose layers keep KV of two kinds (layer i has ``heads[i]`` KV
    heads, as in models with a head count per layer)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    except ImportError:         # vLLM 0.33 plans the KV cache in a module of its own
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    config = EngineArgs(model=_model_dir(tmp_path / "m"), dtype="float32", max_model_len=1024).create_engine_config()
    config.cache_config.kv_cache_layout = "LBHNC"      # what the engine core resolves on a CPU
    block_size = config.cache_config.block_size
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
        block_size=block_size, num_kv_heads=n, head_size=16, dtype=torch.float32) for i, n in enumerate(heads)}
    kv_cache_config = get_kv_cache_config_from_groups(config, get_kv_cache_groups(config, specs), 8 << 20)
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout())
    return config, kv_cache_config, caches


MODEL_ORDER = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def test_mixed_layers_are_in_the_namespace_whatever_order_vllm_keeps_them_in(tmp_path):
    """vLLM groups the caches of unlike layers by spec, in an order of its
    own; the namespace says which layers are alike, in the model's order,
    the same for the scheduler (whose copy of the config keeps one spec per
    group) as for the workers, and is unchanged for engines whose layers
    are alike."""
    import copy

    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    config, kv_cache_config, _ = _mixed_engine(tmp_path)
    mixed = namespace_for(config, kv_cache_config=kv_cache_config)
    assert set(dict(mixed.extra)) == {"layers"}
    assert mixed.digest != namespace_for(config).digest
    scheduler_config = generate_scheduler_kv_cache_config([kv_cache_config])
    assert not hasattr(scheduler_config.kv_cache_groups[0].kv_cache_spec, "kv_cache_specs")   # one spec left
    assert namespace_for(config, kv_cache_config=scheduler_config).digest == mixed.digest

    # The same layers, listed by another vLLM in another order.
    other = copy.deepcopy(kv_cache_config)
    other.kv_cache_tensors.reverse()
    for tensor in other.kv_cache_tensors:
        tensor.layers = list(reversed(tensor.layers))
    other.kv_cache_groups[0].layer_names = list(reversed(other.kv_cache_groups[0].layer_names))
    assert namespace_for(config, kv_cache_config=other).digest == mixed.digest

    _, regrouped, _ = _mixed_engine(tmp_path, heads=(1, 1, 2, 2))      # other layers are alike
    assert namespace_for(config, kv_cache_config=regrouped).digest != mixed.digest
    _, alike, _ = _mixed_engine(tmp_path, heads=(2, 2, 2, 2))
    assert namespace_for(config, kv_cache_config=alike).digest == namespace_for(config).digest


def test_a_block_holds_mixed_layers_in_the_models_order_whatever_order_they_are_registered_in(tmp_path):
    """vLLM 0.32 registers the caches of a model with two kinds of layers
    grouped by kind (layers 0, 2, 1, 3). An engine whose vLLM registers
    them in another order (here the model's) must read each layer's bytes
    of a block into that layer, not into its neighbour."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ucm_connector.connector import UCMConnector

    config, kv_cache_config, caches = _mixed_engine(tmp_path)
    assert list(caches) != MODEL_ORDER and sorted(caches) == MODEL_ORDER     # vLLM's own order is another
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="UCMConnector", kv_role="kv_both",
        kv_connector_extra_config={"store": f"disk://{tmp_path / 'store'}"})
    for layer, name in enumerate(MODEL_ORDER):
        caches[name].copy_(torch.arange(caches[name].numel(), dtype=torch.float32).view_as(caches[name]) + layer * 1e6)
    other = {name: torch.zeros_like(caches[name]) for name in MODEL_ORDER}

    saver = UCMConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    loader = UCMConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    saver.register_kv_caches(caches)
    loader.register_kv_caches(other)
    out = np.zeros((1, saver._worker.transfer.payload_nbytes), dtype=np.uint8)
    saver._worker.transfer.gather([5], out)
    loader._worker.transfer.scatter([7], out)
    for name in MODEL_ORDER:
        assert torch.equal(other[name][7], caches[name][5]), name
    assert [layer.name for layer in saver._worker.transfer.layers] == MODEL_ORDER
    saver.shutdown()
    loader.shutdown()


def test_the_python_files_that_trust_remote_code_runs_are_in_the_namespace(tmp_path):
    model = _model_dir(tmp_path / "m")
    plain = _engine_namespace(model, max_model_len=1024)
    assert _engine_namespace(model, max_model_len=1024, trust_remote_code=True).digest == plain.digest  # no code
    code = os.path.join(model, "configuration_custom.py")
    with open(code, "w") as f:
        f.write("ROPE_SCALE = 1.0\n")
    first = _engine_namespace(model, max_model_len=1024, trust_remote_code=True)
    assert "remote_code" in dict(first.extra) and first.digest != plain.digest
    assert _engine_namespace(model, max_model_len=1024).digest == plain.digest      # code that does not run
    with open(code, "w") as f:
        f.write("ROPE_SCALE = 2.0\n")
    assert _engine_namespace(model, max_model_len=1024, trust_remote_code=True).digest != first.digest


def test_the_engines_multimodal_processing_options_are_in_the_namespace():
    """--mm-processor-kwargs (a resolution cap, pan-and-scan crops) changes
    what an image computes, and vLLM names a request's images by the
    request's own options only."""
    from ucm_connector.layout import engine_settings

    def settings(**mm):
        mm_config = SimpleNamespace(mm_processor_kwargs=mm.get("kwargs"), media_io_kwargs=mm.get("io"))
        return dict(engine_settings(SimpleNamespace(multimodal_config=mm_config, hf_overrides=None)))

    assert settings() == {}
    assert settings(kwargs={"max_pixels": 1003520}) == {"mm_processor_kwargs": '{"max_pixels":1003520}'}
    assert settings(io={"video": {"num_frames": 16}}) == {"media_io_kwargs": '{"video":{"num_frames":16}}'}


def test_dummy_weights_on_a_directory_without_weight_files_start_and_stay_apart(tmp_path):
    """A config-only directory (as for --load-format dummy) used to stop the
    connector at start-up ("no weight files"); it is known by its config."""
    model = _model_dir(tmp_path / "m")
    os.remove(os.path.join(model, "model.safetensors"))
    dummy = _engine_namespace(model, max_model_len=1024, load_format="dummy")
    assert dummy.model_fingerprint.startswith("config:") and dict(dummy.extra) == {"load_format": "dummy"}
    other = _model_dir(tmp_path / "other", rope_theta=500000.0)
    os.remove(os.path.join(other, "model.safetensors"))
    assert _engine_namespace(other, max_model_len=1024, load_format="dummy").digest != dummy.digest


def test_a_loaders_settings_are_in_the_namespace_by_a_digest():
    """--load-format tensorizer takes the weights from the URI in
    --model-loader-extra-config, which may hold credentials."""
    from ucm_connector.layout import load_settings

    def settings(fmt, loader):
        return dict(load_settings(SimpleNamespace(load_config=SimpleNamespace(
            load_format=fmt, model_loader_extra_config=loader), cache_config=SimpleNamespace())))

    a = settings("tensorizer", {"tensorizer_uri": "s3://b/m-v1.tensors", "s3_secret_access_key": "hunter2"})
    b = settings("tensorizer", {"tensorizer_uri": "s3://b/m-v2.tensors", "s3_secret_access_key": "hunter2"})
    assert a["load_format"] == "tensorizer" and a != b
    assert "hunter2" not in json.dumps(a) and "s3://" not in json.dumps(a)
    assert settings("auto", {"concurrency": 4}) == {}          # the model's own files
    assert settings("dummy", {}) == {"load_format": "dummy"}
