"""LoRA adapters in block keys: identified by their files, not their names.

Adapters here are real PEFT adapter directories (adapter_config.json and
adapter_model.safetensors) written to temporary directories. The scheduler
tests drive ``UCMScheduler`` the way vLLM does, with vLLM's own
``LoRARequest``, against a real ``disk://`` store; a new ``UCMScheduler``
stands for a new engine on the same store.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from store_backends import open_store
from ucm_connector import adapters as adapters_module
from ucm_connector.adapters import AdapterIdentities
from ucm_connector.hashing import BlockHasher, Namespace, adapter_fingerprint

BLOCK_SIZE = 16
NUM_BLOCKS = 5
PROMPT = list(range(100, 100 + NUM_BLOCKS * BLOCK_SIZE + 1))   # 5 full blocks + 1 token
CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["k_proj", "v_proj"], "peft_type": "LORA",
          "task_type": "CAUSAL_LM", "use_rslora": False, "bias": "none"}


def write_adapter(path, seed: int = 0, config: dict | None = None, weights_name: str =
                  "adapter_model.safetensors") -> str:
    """A PEFT LoRA adapter directory; the same seed gives the same bytes."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(2):
        for module in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((4, 64), dtype=np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((32, 4), dtype=np.float32)
    save_file(tensors, os.path.join(path, weights_name))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(CONFIG if config is None else config, f)
    return os.fspath(path)


def rewrite_keeping_size_and_mtime(path, seed: int) -> None:
    """A retrained adapter of the same shapes copied over the old one with
    its timestamps preserved (``cp -p``, ``rsync -a``): same size, same mtime."""
    weights = os.path.join(path, "adapter_model.safetensors")
    before = os.stat(weights)
    write_adapter(path, seed=seed)
    assert os.stat(weights).st_size == before.st_size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.utime(os.path.join(path, "adapter_config.json"), ns=(before.st_atime_ns, before.st_mtime_ns))


# -- the fingerprint ---------------------------------------------------------

def test_the_same_adapter_in_two_directories_has_one_fingerprint(tmp_path):
    a = write_adapter(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert adapter_fingerprint(a) == adapter_fingerprint(b)


def test_other_weights_of_the_same_shapes_give_another_fingerprint(tmp_path):
    assert (adapter_fingerprint(write_adapter(tmp_path / "a", seed=0))
            != adapter_fingerprint(write_adapter(tmp_path / "b", seed=1)))


@pytest.mark.parametrize("change", [
    {"r": 8}, {"lora_alpha": 16}, {"use_rslora": True}, {"target_modules": ["k_proj"]},
    {"rank_pattern": {"k_proj": 2}}, {"alpha_pattern": {"v_proj": 32}},
    {"modules_to_save": ["score"]}, {"layers_to_transform": [0]},
    {"a_field_of_a_future_peft": 1},
], ids=lambda change: next(iter(change)))
def test_config_that_can_change_the_output_changes_the_fingerprint(tmp_path, change):
    base = adapter_fingerprint(write_adapter(tmp_path / "a"))
    assert adapter_fingerprint(write_adapter(tmp_path / "b", config={**CONFIG, **change})) != base


@pytest.mark.parametrize("change", [
    {"base_model_name_or_path": "/home/someone/llama"}, {"revision": "v2"},
    {"peft_version": "0.13.0"}, {"lora_dropout": 0.1}, {"inference_mode": True},
    {"_commit_hash": "abc"},
], ids=lambda change: next(iter(change)))
def test_provenance_and_training_only_config_leave_the_fingerprint(tmp_path, change):
    base = adapter_fingerprint(write_adapter(tmp_path / "a"))
    assert adapter_fingerprint(write_adapter(tmp_path / "b", config={**CONFIG, **change})) == base


def test_config_key_order_and_spacing_leave_the_fingerprint(tmp_path):
    base = adapter_fingerprint(write_adapter(tmp_path / "a"))
    b = write_adapter(tmp_path / "b")
    with open(os.path.join(b, "adapter_config.json"), "w") as f:
        json.dump(dict(reversed(list(CONFIG.items()))), f, indent=4)
    assert adapter_fingerprint(b) == base


def test_only_the_weight_file_vllm_loads_counts(tmp_path):
    a = write_adapter(tmp_path / "a")
    base = adapter_fingerprint(a)
    # vLLM loads adapter_model.safetensors when present; a stale .bin is ignored.
    write_adapter(tmp_path / "other", seed=5, weights_name="adapter_model.bin")
    shutil.copy(tmp_path / "other" / "adapter_model.bin", tmp_path / "a" / "adapter_model.bin")
    assert adapter_fingerprint(a) == base
    os.remove(tmp_path / "a" / "adapter_model.safetensors")
    assert adapter_fingerprint(a) != base


def test_an_adapter_without_weights_or_config_cannot_be_fingerprinted(tmp_path):
    a = write_adapter(tmp_path / "a")
    os.remove(os.path.join(a, "adapter_model.safetensors"))
    with pytest.raises(FileNotFoundError, match="adapter weights"):
        adapter_fingerprint(a)
    b = write_adapter(tmp_path / "b")
    os.remove(os.path.join(b, "adapter_config.json"))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        adapter_fingerprint(b)


# -- identities, per engine --------------------------------------------------

@pytest.fixture
def count_hashing(monkeypatch):
    calls = []

    def counting(path):
        calls.append(path)
        return adapter_fingerprint(path)

    monkeypatch.setattr(adapters_module, "adapter_fingerprint", counting)
    return calls


def test_an_adapter_is_hashed_once_however_many_requests_use_it(tmp_path, count_hashing):
    a = write_adapter(tmp_path / "a")
    identities = AdapterIdentities()
    first = identities.identity(1, a, "ad")
    assert all(identities.identity(1, a, "ad") == first for _ in range(100))
    assert len(count_hashing) == 1


def test_one_adapter_under_two_ids_is_hashed_once(tmp_path, count_hashing):
    a = write_adapter(tmp_path / "a")
    identities = AdapterIdentities()
    assert identities.identity(1, a, "ad") == identities.identity(2, a, "ad-again")
    assert len(count_hashing) == 1


def test_touched_but_unchanged_files_keep_the_identity(tmp_path, count_hashing):
    a = write_adapter(tmp_path / "a")
    identities = AdapterIdentities()
    first = identities.identity(1, a, "ad")
    os.utime(os.path.join(a, "adapter_model.safetensors"))
    assert identities.identity(1, a, "ad") == first
    assert len(count_hashing) == 2


def test_the_identity_names_neither_path_nor_name(tmp_path):
    a = write_adapter(tmp_path / "a")
    identity = AdapterIdentities().identity(1, a, "my-adapter")
    assert identity == f"lora:{adapter_fingerprint(a)}"
    assert "my-adapter" not in identity and str(tmp_path) not in identity


def test_engine_lora_settings_enter_the_identity(tmp_path):
    a = write_adapter(tmp_path / "a")
    assert (AdapterIdentities("lora_dtype=bfloat16").identity(1, a)
            != AdapterIdentities("lora_dtype=float32").identity(1, a))


def test_an_unreadable_adapter_has_no_identity_and_is_logged_once(tmp_path, caplog):
    identities = AdapterIdentities()
    with caplog.at_level(logging.WARNING, logger="vllm.ucm_connector.adapters"):
        for _ in range(3):
            assert identities.identity(1, "some-org/hub-adapter", "hub") is None
    assert len(caplog.records) == 1
    assert "hub-adapter" in caplog.records[0].getMessage()


def test_an_adapter_with_unreadable_weights_has_no_identity(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    a = write_adapter(tmp_path / "a")
    os.chmod(os.path.join(a, "adapter_model.safetensors"), 0)
    assert AdapterIdentities().identity(1, a) is None


def test_an_adapter_with_a_broken_config_has_no_identity(tmp_path):
    a = write_adapter(tmp_path / "a")
    with open(os.path.join(a, "adapter_config.json"), "w") as f:
        f.write("{not json")
    assert AdapterIdentities().identity(1, a) is None


def test_files_changed_under_a_served_adapter_id_stop_its_sharing(tmp_path):
    a = write_adapter(tmp_path / "a", seed=0)
    identities = AdapterIdentities()
    assert identities.identity(1, a, "ad") is not None
    rewrite_keeping_size_and_mtime(a, seed=1)
    # The workers may still hold the old weights under id 1, or the new ones.
    assert identities.identity(1, a, "ad") is None
    assert identities.identity(1, a, "ad") is None
    # A new id makes vLLM load the files afresh: the new weights, identified.
    assert identities.identity(2, a, "ad") == f"lora:{adapter_fingerprint(a)}"


# -- the scheduler: what engines share --------------------------------------

def make_namespace() -> Namespace:
    return Namespace(model_fingerprint="0123456789abcdef0123456789abcdef", dtype="bfloat16",
                     kv_layout="CPU_ATTN/vec", block_size=BLOCK_SIZE, num_layers=2,
                     num_kv_heads=2, head_size=32)


class Engine:
    """One engine's scheduler role on a shared store, serving one request at
    a time; the workers' saves are stood in for by putting the planned keys."""

    def __init__(self, store) -> None:
        from ucm_connector.metrics import StatsCollector
        from ucm_connector.scheduler import UCMScheduler

        self.store = store
        self.scheduler = UCMScheduler(store=store, hasher=BlockHasher(make_namespace()),
                                      block_size=BLOCK_SIZE, tp_size=1, load=True, save=True,
                                      min_hit_blocks=1, stats=StatsCollector())
        self._next_id = 0

    def serve(self, tokens: list[int], lora_request) -> SimpleNamespace:
        """Hit tokens (loaded from the store) and the keys saved."""
        self._next_id += 1
        request = SimpleNamespace(
            request_id=f"req-{self._next_id}", lora_request=lora_request, mm_features=None,
            cache_salt=None, prompt_embeds=None, all_token_ids=list(tokens),
            num_tokens=len(tokens), num_computed_tokens=0)
        hit_tokens, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        block_ids = list(range(1, num_blocks + 1))      # vLLM keeps block 0 as its null block
        if hit_tokens:
            blocks = SimpleNamespace(get_block_ids=lambda: (block_ids,))
            self.scheduler.update_state_after_alloc(request, blocks, hit_tokens)
        request.num_computed_tokens = hit_tokens
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=request.request_id, block_ids=(block_ids,))],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
            num_scheduled_tokens={request.request_id: len(tokens) - hit_tokens})
        loads, saves = self.scheduler.build_plans(output)
        saved = [key for plan in saves for key in plan.keys]
        if saved:
            self.store.put(saved, [b"kv"] * len(saved))
        self.scheduler.request_finished(request)
        return SimpleNamespace(hit_tokens=hit_tokens, saved=saved,
                               loaded=[key for plan in loads for key in plan.keys])


def lora(name: str, int_id: int, path) -> object:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=os.fspath(path))


@pytest.fixture
def store(tmp_path):
    store = open_store(f"disk://{tmp_path}/store")
    yield store
    store.close()


FULL_HIT = NUM_BLOCKS * BLOCK_SIZE


def test_two_adapters_with_one_name_never_share_a_block(tmp_path, store):
    first = write_adapter(tmp_path / "deploy-1" / "ad", seed=0)
    second = write_adapter(tmp_path / "deploy-2" / "ad", seed=1)
    assert len(Engine(store).serve(PROMPT, lora("ad", 1, first)).saved) == NUM_BLOCKS
    other = Engine(store).serve(PROMPT, lora("ad", 1, second))
    assert other.hit_tokens == 0
    assert len(other.saved) == NUM_BLOCKS
    # Each adapter still finds its own blocks.
    assert Engine(store).serve(PROMPT, lora("ad", 1, first)).hit_tokens == FULL_HIT
    assert Engine(store).serve(PROMPT, lora("ad", 1, second)).hit_tokens == FULL_HIT


def test_the_same_adapter_from_two_paths_under_two_names_shares_blocks(tmp_path, store):
    original = write_adapter(tmp_path / "a" / "sql", seed=0)
    copy = tmp_path / "mirror" / "sql-v1"
    shutil.copytree(original, copy)
    Engine(store).serve(PROMPT, lora("sql", 1, original))
    served = Engine(store).serve(PROMPT, lora("sql-v1", 3, copy))
    assert served.hit_tokens == FULL_HIT
    assert served.saved == []


def test_an_adapter_redeployed_under_its_path_misses_the_old_blocks(tmp_path, store):
    path = write_adapter(tmp_path / "ad", seed=0)
    Engine(store).serve(PROMPT, lora("ad", 1, path))
    rewrite_keeping_size_and_mtime(path, seed=1)
    assert Engine(store).serve(PROMPT, lora("ad", 1, path)).hit_tokens == 0


def test_an_adapter_and_the_base_model_never_share_a_block(tmp_path, store):
    path = write_adapter(tmp_path / "ad")
    Engine(store).serve(PROMPT, None)
    assert Engine(store).serve(PROMPT, lora("ad", 1, path)).hit_tokens == 0


def test_an_unreadable_adapter_neither_loads_nor_saves(tmp_path, store):
    Engine(store).serve(PROMPT, None)
    engine = Engine(store)
    for path in ("some-org/hub-adapter", tmp_path / "missing"):
        served = engine.serve(PROMPT, lora("ad", 1, path))
        assert (served.hit_tokens, served.saved) == (0, [])
    assert sum(len(keys) for keys in store.iter_keys()) == NUM_BLOCKS


def test_an_adapter_changed_under_a_live_engine_stops_sharing_there(tmp_path, store):
    path = write_adapter(tmp_path / "ad", seed=0)
    engine = Engine(store)
    engine.serve(PROMPT, lora("ad", 1, path))
    rewrite_keeping_size_and_mtime(path, seed=1)
    # vLLM's workers may still run the old weights under id 1.
    served = engine.serve(PROMPT, lora("ad", 1, path))
    assert (served.hit_tokens, served.saved) == (0, [])
    # Under a new id they load the new files, which have no blocks yet.
    served = engine.serve(PROMPT, lora("ad", 2, path))
    assert served.hit_tokens == 0 and len(served.saved) == NUM_BLOCKS


# -- the engine's LoRA settings ---------------------------------------------

def vllm_config_with(lora_config, model_dtype: str = "bfloat16"):
    import torch

    return SimpleNamespace(lora_config=lora_config,
                           model_config=SimpleNamespace(dtype=getattr(torch, model_dtype)))


def test_engine_lora_settings_follow_what_changes_an_adapters_output():
    from vllm.config import LoRAConfig

    from ucm_connector.layout import lora_engine_settings

    base = lora_engine_settings(vllm_config_with(LoRAConfig(max_lora_rank=8)))
    assert lora_engine_settings(vllm_config_with(None)) == ""
    # "auto" is the model's dtype.
    assert base == lora_engine_settings(vllm_config_with(LoRAConfig(max_lora_rank=8,
                                                                    lora_dtype="bfloat16")))
    assert base != lora_engine_settings(vllm_config_with(LoRAConfig(max_lora_rank=8),
                                                         model_dtype="float16"))
    for changed in (dict(lora_dtype="float16"), dict(target_modules=["k_proj"]),
                    dict(fully_sharded_loras=True)):
        assert base != lora_engine_settings(vllm_config_with(LoRAConfig(max_lora_rank=8, **changed)))
    for inert in (dict(max_loras=4), dict(max_cpu_loras=8)):
        assert base == lora_engine_settings(vllm_config_with(LoRAConfig(max_lora_rank=8, **inert)))
    assert base == lora_engine_settings(vllm_config_with(LoRAConfig(max_lora_rank=64)))


def test_a_weights_name_that_is_not_a_file_is_passed_over_as_vllm_does(tmp_path):
    a = write_adapter(tmp_path / "a", seed=0, weights_name="adapter_model.bin")
    os.mkdir(os.path.join(a, "adapter_model.safetensors"))
    identities = AdapterIdentities()
    assert identities.identity(1, a) == f"lora:{adapter_fingerprint(a)}"
    weights = os.path.join(a, "adapter_model.bin")
    before = os.stat(weights)
    write_adapter(tmp_path / "new", seed=1, weights_name="adapter_model.bin")
    shutil.copyfile(tmp_path / "new" / "adapter_model.bin", weights)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    # vLLM would load the rewritten .bin: the files changed under id 1.
    assert identities.identity(1, a) is None
