"""``ucm explain``: why a prompt would (partly) miss the store, block by block.

Owns the command's arguments, its report (text and JSON) and its exit
status; ``ucm`` registers it as a command (``SUMMARY``, ``HELP``,
``add_arguments``, ``run``).

It tokenises a prompt as vLLM would (the model's tokenizer, special tokens
added for a completion prompt; the chat template on request), finds every
namespace the store's manifests record, computes the prompt's block keys
under each, and asks the store which blocks it holds, for every TP rank.
The hit is what the scheduler would answer (``scheduler.py``): the leading
full blocks present on every rank, at most ``(num_tokens - 1) // block_size``
of them (a request always computes its last token), none below
``--min-hit-blocks``. At the first block a request would not load it names
the likely reason, from the most specific to the least: a TP rank's shard
is missing; a later block is there (this one was evicted); the prompt is
stored without the given cache_salt or LoRA adapter; another namespace holds
more of the prompt (the fields that differ are named: model weights, dtype,
KV layout, block size, geometry, TP size); the store holds nothing for this
model; or the prompt diverges there from everything stored.

What it must not do: import vLLM or torch (``transformers`` is imported
inside ``run``, only to tokenise text), change the store (it is opened with
``OpenMode.INSPECT``: nothing is evicted, no server is started; keys are
listed and asked ``contains``, manifests are peeked), or print a password
(store URLs are masked; cache_salt values are never printed).

It sees a namespace only through its manifest, which every saving engine
rank writes when it starts; blocks whose manifest is gone are not looked at
(``ucm store stats`` lists them by digest).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .hashing import Namespace

SUMMARY = "why a prompt would (partly) miss the store, block by block"

HELP = """\
Tokenise a prompt with the model's tokenizer, as vLLM does (special tokens added
for a completion prompt; --chat applies the chat template), compute its block keys
under every namespace the store's manifests record, and show block by block what
the store holds. Then: how many leading full blocks a request would load (all TP
ranks' shards present, never the prompt's last token, at least --min-hit-blocks),
the first block it would not load and its tokens, and the likely reason:

  diverges          the prompt differs there from every prompt stored
  evicted           a later block of the prompt is stored, but not this one
  tp_shard_missing  some TP ranks' shards of the block are stored, not all
  cache_salt, lora, cache_salt_and_lora
                    the prompt is stored without the given cache_salt or adapter
  other_namespace   another namespace of this model holds more of the prompt; the
                    fields that differ are named (dtype, KV layout, block size,
                    layer/head geometry, TP size, block format)
  other_model       only another model's namespace holds it (other weights or config)
  no_namespace      no namespace of this model matches --dtype/--block-size/...
  no_model          the store holds nothing for this model
  min_hit_blocks    the stored leading blocks are fewer than --min-hit-blocks
  full_hit          every block a request could load is stored
  too_short         the prompt has no full block a request could load

Which namespace is this engine's: the one of this model that --namespace, --dtype,
--block-size, --tp-size and --kv-layout select; among several, the one that holds
the most of the prompt (the others are listed). The model's fingerprint is that of
the files in --model (as the connector computes it), not its path.

cache_salt and LoRA adapters change every key of a request but are not in the
namespace: give the request's --cache-salt and --lora (the adapter's directory; the
engine's LoRA defaults are assumed). With them, the prompt is also looked up
without them, and the report says when that would hit more.

The store is opened read-only: nothing is evicted, no shm:// server is started, and
asking does not count as a use. Its URL is shown with any password masked. Its keys
are listed once to find the manifests (a store that cannot list them cannot be
explained); a namespace whose manifest is gone is not seen."""

_EPILOG = """\
examples:
  ucm explain --store disk:///var/cache/ucm --model /models/llama-3-8b --prompt-file prompt.txt
  ucm explain --store redis://cache-1:6379/0 --model /models/llama-3-8b --prompt 'Hello' --chat
  ucm explain --store shm://ucm --model /models/llama-3-8b --token-ids ids.json --json
  ucm explain --store disk:///var/cache/ucm --model /models/llama-3-8b --prompt-file p.txt \\
      --dtype float32 --block-size 64

exit status:
  0    every block a request could load is stored (or the prompt has none)
  1    a request would miss some of them; the report says where and why
  2    bad command line or input (no such model, tokenizer or file; a malformed
       URL; a store that cannot be opened)
  3    the store failed during the command, or cannot list its keys"""

EXIT_OK = 0
EXIT_MISS = 1
EXIT_USAGE = 2
EXIT_STORE = 3

_CONTAINS_BATCH = 1000


class ExplainError(Exception):
    """Something the user can fix; one line on stderr, exit ``status``."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


# -- the command line --------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ucm explain``."""
    if parser.epilog is None:
        parser.epilog = _EPILOG
    if parser.formatter_class is argparse.HelpFormatter:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--store", required=True, action="append", metavar="URL",
                        help="the store's URL; repeat for a tier, fastest first, as in the connector's "
                             "'store' list")
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="the model directory the engines serve (its files give the fingerprint; "
                             "its tokenizer tokenises the prompt)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt text from FILE ('-': stdin)")
    prompt.add_argument("--token-ids", metavar="FILE",
                        help="the prompt's token ids: a JSON list, or integers separated by spaces or commas "
                             "('-': stdin)")
    parser.add_argument("--chat", action="store_true",
                        help="apply the model's chat template to the prompt, as /v1/chat/completions does: "
                             "the text is one user message, or a JSON list of {role, content} messages")
    parser.add_argument("--tokenizer", metavar="DIR", help="the tokenizer's directory (default: --model)")
    parser.add_argument("--cache-salt", metavar="SALT", help="the request's cache_salt")
    parser.add_argument("--lora", metavar="DIR", help="the directory of the request's LoRA adapter")
    select = parser.add_argument_group("which namespace is this engine's (default: the one that holds most)")
    select.add_argument("--namespace", metavar="HEX", help="a namespace digest, or 4+ leading hex digits of one")
    select.add_argument("--dtype", metavar="DTYPE", help="the engine's dtype (bfloat16, float16, float32)")
    select.add_argument("--block-size", type=int, metavar="N", help="the engine's block size in tokens")
    select.add_argument("--tp-size", type=int, metavar="N", help="the engine's tensor-parallel size")
    select.add_argument("--kv-layout", metavar="LAYOUT",
                        help="the engine's KV layout as `ucm store stats` shows it (e.g. cpu/CPU_ATTN/vec/auto)")
    parser.add_argument("--min-hit-blocks", type=int, default=1, metavar="N",
                        help="the connector's min_hit_blocks: shorter hits are computed (default 1)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    """``ucm explain``: print the report; the exit status (see ``HELP``)."""
    from store_backends import StoreError, StoreOpenError
    from store_backends.urls import mask_password

    try:
        report = explain(args)
    except ExplainError as exc:
        _error(exc)
        return exc.status
    except StoreOpenError as exc:
        _error(exc)
        return EXIT_USAGE
    except StoreError as exc:
        _error(exc)
        return EXIT_STORE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        _error("interrupted")
        return 130
    except OSError as exc:
        # An unexpected I/O error still gets one line, never a password.
        _error(mask_password(str(exc)))
        return EXIT_USAGE
    try:
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            sys.stdout.write(report.render())
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK if report.reason in ("full_hit", "too_short") else EXIT_MISS


def _error(message: object) -> None:
    print(f"ucm: {' '.join(str(message).split())}", file=sys.stderr)


# -- the prompt -------------------------------------------------------------------

def _read_text(path: str, what: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ExplainError(f"{what} {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ExplainError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None


def parse_token_ids(text: str, where: str) -> list[int]:
    """Token ids from a JSON list or from integers separated by spaces or commas."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            ids = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ExplainError(f"{where}: not a JSON list of token ids: {exc.msg} (line {exc.lineno}, "
                               f"column {exc.colno})") from None
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ExplainError(f"{where}: the JSON list must hold integers only")
    else:
        try:
            ids = [int(t) for t in stripped.replace(",", " ").split()]
        except ValueError as exc:
            raise ExplainError(f"{where}: not a list of token ids ({exc})") from None
    bad = [t for t in ids if not 0 <= t < 1 << 32]
    if bad:
        raise ExplainError(f"{where}: token id {bad[0]} is out of range (0 to 2**32 - 1)")
    if not ids:
        raise ExplainError(f"{where}: no token ids")
    return ids


def _chat_messages(text: str) -> list[dict]:
    try:
        messages = json.loads(text)
    except json.JSONDecodeError:
        return [{"role": "user", "content": text}]
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
        return messages
    return [{"role": "user", "content": text}]


def _tokenize(text: str, tokenizer_dir: str, chat: bool) -> list[int]:
    if not os.path.isdir(tokenizer_dir):
        raise ExplainError(f"cannot tokenise the prompt: {tokenizer_dir!r} is not a directory (give the model "
                           f"directory, --tokenizer DIR, or the prompt's --token-ids)")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ExplainError(f"cannot tokenise the prompt without transformers ({exc}): pip install transformers, "
                           f"or give the prompt's --token-ids") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as exc:  # transformers raises many kinds for a broken directory
        raise ExplainError(f"cannot load the tokenizer in {tokenizer_dir!r}: {exc}") from None
    if not chat:
        # vLLM's completion prompts: the tokenizer's special tokens (BOS) added.
        return list(tokenizer.encode(text, add_special_tokens=True))
    try:
        rendered = tokenizer.apply_chat_template(_chat_messages(text), tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as exc:
        raise ExplainError(f"cannot apply the chat template of {tokenizer_dir!r}: {exc}") from None
    # The template writes the special tokens itself, so vLLM adds none.
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def prompt_token_ids(args: argparse.Namespace) -> list[int]:
    if args.token_ids is not None:
        if args.chat:
            raise ExplainError("--chat applies to a text prompt; --token-ids are used as they are")
        return parse_token_ids(_read_text(args.token_ids, "token ids file"), f"token ids {args.token_ids!r}")
    text = args.prompt if args.prompt is not None else _read_text(args.prompt_file, "prompt file")
    if not text:
        raise ExplainError("the prompt is empty")
    return _tokenize(text, args.tokenizer or args.model, args.chat)


def model_identity(model: str) -> str:
    """The model fingerprint the connector puts in its namespaces for
    ``--model`` (``layout._fingerprint``, without importing torch)."""
    from .hashing import model_fingerprint

    if os.path.exists(model):
        try:
            return model_fingerprint(model)
        except (OSError, ValueError) as exc:
            raise ExplainError(f"cannot fingerprint the model {model!r}: {exc}") from None
    # A hub name with no local files: the name is all the connector goes on.
    import xxhash

    return "name:" + xxhash.xxh3_128_hexdigest(model.encode())


# -- namespaces and lookups -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Deployment:
    """One deployment's namespace as its manifests record it: the namespace
    of rank 0 (all ranks share one key chain) and the ranks whose manifest
    the store holds."""

    namespace: Namespace       # rank 0's
    model_name: str | None
    digests: tuple[bytes, ...]
    created: float

    @property
    def digest(self) -> bytes:
        return self.namespace.digest

    def describe(self) -> str:
        ns = self.namespace
        model = self.model_name or f"model {ns.model_fingerprint[:12]}"
        extra = "".join(f", {k}={v}" for k, v in ns.extra)
        return (f"{model} {ns.dtype} {ns.kv_layout}, block {ns.block_size}, {ns.num_layers} layers x "
                f"{ns.num_kv_heads} kv heads x {ns.head_size}, tp size {ns.tp_size}, "
                f"format v{ns.format_version}{extra}")

    def to_dict(self) -> dict:
        return {"digest": self.digest.hex(), "rank_digests": [d.hex() for d in self.digests],
                "model_name": self.model_name, "description": self.describe(),
                "namespace": {k: (list(map(list, v)) if k == "extra" else v)
                              for k, v in dataclasses.asdict(self.namespace).items() if k != "tp_rank"}}


def find_deployments(store) -> tuple[list[Deployment], int]:
    """Every deployment whose manifests the store holds, and how many
    manifests could not be read."""
    from .manifest import Manifest, NewerManifestError, digest_of, is_manifest_key, read_manifests

    from store_backends import StoreError

    try:
        digests = [digest_of(key) for batch in store.iter_keys(1000) for key in batch if is_manifest_key(key)]
    except StoreError as exc:
        raise StoreError(f"{exc} (ucm explain lists the store's keys to find its namespace manifests)") from None
    groups: dict[bytes, list] = {}
    unreadable = 0
    for digest, manifest in read_manifests(store, digests).items():
        if not isinstance(manifest, Manifest):
            unreadable += not isinstance(manifest, NewerManifestError)
            continue
        rank0 = manifest.namespace.for_rank(0)
        groups.setdefault(rank0.digest, []).append(manifest)
    deployments = []
    for manifests in groups.values():
        manifests.sort(key=lambda m: m.namespace.tp_rank)
        deployments.append(Deployment(
            namespace=manifests[0].namespace.for_rank(0),
            model_name=next((m.model_name for m in manifests if m.model_name), None),
            digests=tuple(m.digest for m in manifests),
            created=max(m.created for m in manifests)))
    deployments.sort(key=lambda d: d.digest)
    return deployments, unreadable


@dataclasses.dataclass(frozen=True)
class Block:
    """One full block of the prompt under one namespace."""

    index: int
    start: int                          # tokens [start, end)
    end: int
    loadable: bool                      # within the scheduler's cap
    stored_ranks: tuple[int, ...]
    tp_size: int

    @property
    def stored(self) -> bool:
        return len(self.stored_ranks) == self.tp_size

    def to_dict(self) -> dict:
        return {"index": self.index, "start": self.start, "end": self.end, "stored": self.stored,
                "loadable": self.loadable,
                "missing_ranks": [r for r in range(self.tp_size) if r not in self.stored_ranks]}


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What a request for the prompt would find under one deployment's namespace."""

    deployment: Deployment
    with_salt: bool
    with_lora: bool
    blocks: tuple[Block, ...]
    max_blocks: int                     # the scheduler's cap: (num_tokens - 1) // block_size
    leading_blocks: int                 # leading loadable blocks stored on every rank
    hit_blocks: int                     # after min_hit_blocks

    @property
    def block_size(self) -> int:
        return self.deployment.namespace.block_size

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def held_tokens(self) -> int:
        """Leading tokens of the prompt stored here, whether loadable or not."""
        n = 0
        for block in self.blocks:
            if not block.stored:
                break
            n = block.end
        return n


@functools.lru_cache(maxsize=4)
def _adapter_fingerprint(lora_dir: str) -> str:
    from .hashing import adapter_fingerprint

    try:
        return adapter_fingerprint(lora_dir)
    except (OSError, ValueError) as exc:
        raise ExplainError(f"cannot fingerprint the LoRA adapter {lora_dir!r}: {exc}") from None


def _lora_identity(lora_dir: str, dtype: str) -> str:
    """The adapter's identity in an engine of ``dtype`` with vLLM's LoRA
    defaults (``--lora-dtype auto``, no ``target_modules`` restriction)."""
    from .adapters import adapter_identity, lora_settings

    return adapter_identity(_adapter_fingerprint(lora_dir), lora_settings(dtype=dtype))


def look_up(store, deployment: Deployment, token_ids: Sequence[int], *, cache_salt: str | None,
            lora_dir: str | None, min_hit_blocks: int) -> Lookup:
    """The prompt's blocks under ``deployment``, present on which ranks."""
    from .hashing import BlockHasher, keys_for_rank

    ns = deployment.namespace
    lora = _lora_identity(lora_dir, ns.dtype) if lora_dir is not None else None
    keys = BlockHasher(ns).block_keys(token_ids, lora=lora, cache_salt=cache_salt)
    stored_ranks: list[list[int]] = [[] for _ in keys]
    for rank in range(ns.tp_size):
        rank_keys = keys_for_rank(keys, rank)
        for first in range(0, len(keys), _CONTAINS_BATCH):
            part = rank_keys[first:first + _CONTAINS_BATCH]
            for i, present in enumerate(store.contains(part), first):
                if present:
                    stored_ranks[i].append(rank)
    bs = ns.block_size
    max_blocks = min(len(keys), max(0, (len(token_ids) - 1) // bs))
    blocks = tuple(Block(i, i * bs, (i + 1) * bs, i < max_blocks, tuple(ranks), ns.tp_size)
                   for i, ranks in enumerate(stored_ranks))
    leading = 0
    while leading < max_blocks and blocks[leading].stored:
        leading += 1
    return Lookup(deployment, cache_salt is not None, lora_dir is not None, blocks, max_blocks, leading,
                  leading if leading >= min_hit_blocks else 0)


# Namespace fields as a report names them, in the order they are compared.
_FIELDS = (("model_fingerprint", "model weights"), ("dtype", "dtype"), ("kv_layout", "KV layout"),
           ("block_size", "block size"), ("num_layers", "layers"), ("num_kv_heads", "kv heads"),
           ("head_size", "head size"), ("tp_size", "TP size"), ("format_version", "block format version"),
           ("extra", "extra fields"))


def differences(this: dict, other) -> list[dict]:
    """The namespace fields in which ``other`` (a Namespace) differs from
    ``this`` (field -> value: a whole namespace, or what the user selected)."""
    out = []
    for field, label in _FIELDS:
        if field not in this:
            continue
        mine, theirs = this[field], getattr(other, field)
        if mine != theirs:
            out.append({"field": field, "label": label, "this": _jsonable(mine), "other": _jsonable(theirs)})
    return out


def _jsonable(value):
    return [list(pair) for pair in value] if isinstance(value, tuple) else value


def _namespace_fields(ns) -> dict:
    return {field: getattr(ns, field) for field, _ in _FIELDS}


def _say_differences(diffs: list[dict]) -> str:
    def short(field, value):
        return str(value)[:12] if field == "model_fingerprint" else str(value)

    return "; ".join(f"{d['label']} {short(d['field'], d['other'])} (this engine: {short(d['field'], d['this'])})"
                     for d in diffs) or "no field of the selection"


def _normalize_dtype(dtype: str) -> str:
    dtype = dtype.strip().lower()
    dtype = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(dtype, dtype)


# -- the report -------------------------------------------------------------------

@dataclasses.dataclass
class Report:
    store: str                          # masked
    model: str
    model_fingerprint: str
    num_tokens: int
    cache_salt_given: bool
    lora: str | None
    selection: dict
    target: Lookup | None
    block_size: int | None
    blocks: list[Block]
    max_blocks: int
    stored_prefix_blocks: int
    first_miss: Block | None
    reason: str
    message: str
    others: list[tuple[Lookup, list[dict]]]       # other deployments and how they differ
    alternatives: list[Lookup]                    # the target without salt / adapter
    notes: list[str]

    @property
    def hit_tokens(self) -> int:
        return self.stored_prefix_blocks * (self.block_size or 0)

    def to_dict(self) -> dict:
        def lookup_dict(lk: Lookup) -> dict:
            return {"stored_prefix_blocks": lk.hit_blocks, "hit_tokens": lk.hit_tokens,
                    "block_size": lk.block_size, "stored_tokens": lk.held_tokens,
                    "with_cache_salt": lk.with_salt, "with_lora": lk.with_lora}

        return {
            "store": self.store,
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "num_tokens": self.num_tokens,
            "with_cache_salt": self.cache_salt_given,
            "lora": self.lora,
            "selection": self.selection,
            "namespace": self.target.deployment.to_dict() if self.target else None,
            "block_size": self.block_size,
            "blocks": [b.to_dict() for b in self.blocks],
            "loadable_blocks": self.max_blocks,
            "stored_prefix_blocks": self.stored_prefix_blocks,
            "hit_tokens": self.hit_tokens,
            "first_miss": None if self.first_miss is None else
            {"index": self.first_miss.index, "start": self.first_miss.start, "end": self.first_miss.end},
            "reason": self.reason,
            "message": self.message,
            "other_namespaces": [{**lk.deployment.to_dict(), **lookup_dict(lk),
                                  "same_model": lk.deployment.namespace.model_fingerprint == self.model_fingerprint,
                                  "differences": diffs} for lk, diffs in self.others],
            "alternatives": [lookup_dict(lk) for lk in self.alternatives],
            "notes": self.notes,
        }

    def render(self) -> str:
        lines = [f"store {self.store} (read-only)",
                 f"model {self.model} (fingerprint {self.model_fingerprint[:12]}), prompt of "
                 f"{_plural(self.num_tokens, 'token')}"
                 + (", with a cache_salt" if self.cache_salt_given else "")
                 + (f", LoRA adapter {self.lora}" if self.lora else "")]
        if self.target is not None:
            lines.append(f"namespace {self.target.deployment.digest.hex()[:16]}  "
                         f"{self.target.deployment.describe()}")
        else:
            chosen = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.selection.items())
            lines.append("namespace: none in the store" + (f" with {chosen}" if chosen else ""))
        if self.blocks:
            lines += ["", f"{'BLOCKS':<12}  {'TOKENS':<15}  STORED"]
            for first, last, status in _runs(self.blocks, self.first_miss):
                span = str(first.index) if first is last else f"{first.index}-{last.index}"
                lines.append(f"{span:<12}  {f'{first.start}-{last.end - 1}':<15}  {status}")
        if self.block_size and self.num_tokens % self.block_size:
            tail = self.num_tokens - self.num_tokens % self.block_size
            lines.append(f"{'':<12}  {f'{tail}-{self.num_tokens - 1}':<15}  "
                         f"(partial block: always computed, never stored)")
        lines.append("")
        if self.hit_tokens:
            lines.append(f"a request would load {_plural(self.stored_prefix_blocks, 'block')} "
                         f"({self.hit_tokens} of {self.num_tokens} tokens) and compute the other "
                         f"{self.num_tokens - self.hit_tokens}")
        else:
            lines.append(f"a request would load nothing and compute all {_plural(self.num_tokens, 'token')}")
        if self.first_miss is not None:
            lines.append(f"first miss: block {self.first_miss.index} (tokens {self.first_miss.start}-"
                         f"{self.first_miss.end - 1})")
        lines.append(f"reason: {self.reason}: {self.message}")
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.others:
            lines += ["", "other namespaces in the store:"]
            for lk, diffs in self.others:
                lines.append(f"  {lk.deployment.digest.hex()[:16]}  {lk.deployment.describe()}")
                lines.append(f"      would load {_plural(lk.hit_blocks, 'block')} ({lk.hit_tokens} tokens); "
                             f"differs in {_say_differences(diffs)}")
        return "\n".join(lines) + "\n"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _status(block: Block, first_miss: Block | None) -> str:
    if block.stored:
        text = "yes" if block.loadable else "yes (not loaded: a request computes its last token)"
    elif block.stored_ranks:
        missing = [r for r in range(block.tp_size) if r not in block.stored_ranks]
        text = f"no: rank {', '.join(map(str, missing))} missing"
    else:
        text = "no"
    if first_miss is not None and block.index == first_miss.index:
        text += "   <- first miss"
    return text


def _runs(blocks: list[Block], first_miss: Block | None):
    """Consecutive blocks of the same status, as (first, last, status)."""
    out = []
    for block in blocks:
        status = _status(block, first_miss)
        if out and out[-1][2] == status and "first miss" not in status:
            out[-1][1] = block
        else:
            out.append([block, block, status])
    return out


# -- the explanation ----------------------------------------------------------------

def _selection(args: argparse.Namespace) -> dict:
    chosen = {}
    if args.dtype:
        chosen["dtype"] = _normalize_dtype(args.dtype)
    if args.block_size is not None:
        chosen["block_size"] = args.block_size
    if args.tp_size is not None:
        chosen["tp_size"] = args.tp_size
    if args.kv_layout:
        chosen["kv_layout"] = args.kv_layout.strip()
    return chosen


def _matches(deployment: Deployment, selection: dict, namespace_prefix: str | None) -> bool:
    ns = deployment.namespace
    if any(getattr(ns, field) != value for field, value in selection.items()):
        return False
    if namespace_prefix:
        return any(d.hex().startswith(namespace_prefix) for d in deployment.digests + (deployment.digest,))
    return True


def _check_args(args: argparse.Namespace) -> str | None:
    for name in ("block_size", "tp_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ExplainError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.min_hit_blocks < 0:
        raise ExplainError(f"--min-hit-blocks must be 0 or more, got {args.min_hit_blocks}")
    if args.lora is not None:
        from .hashing import adapter_files

        try:
            adapter_files(args.lora)
        except FileNotFoundError as exc:
            raise ExplainError(f"--lora: {exc}") from None
    prefix = args.namespace.strip().lower() if args.namespace else None
    if prefix is not None and (len(prefix) < 4 or any(c not in "0123456789abcdef" for c in prefix)):
        raise ExplainError(f"--namespace {args.namespace!r}: give a namespace digest or 4+ of its leading hex "
                           f"digits, as `ucm store stats` prints them")
    return prefix


def explain(args: argparse.Namespace) -> Report:
    """Open the store read-only and build the report (no output)."""
    from store_backends import OpenMode, open_store
    from store_backends.urls import mask_password

    namespace_prefix = _check_args(args)
    urls = [url.strip() for url in args.store]
    shown = ", ".join(mask_password(url) for url in urls)
    fingerprint = model_identity(args.model)
    token_ids = prompt_token_ids(args)
    with open_store(urls if len(urls) > 1 else urls[0], OpenMode.INSPECT) as store:
        deployments, unreadable = find_deployments(store)
        salt, lora_dir, min_hit = args.cache_salt, args.lora, args.min_hit_blocks
        lookups = {d.digest: look_up(store, d, token_ids, cache_salt=salt, lora_dir=lora_dir,
                                     min_hit_blocks=min_hit) for d in deployments}
        same_model = [d for d in deployments if d.namespace.model_fingerprint == fingerprint]
        selection = _selection(args)
        matching = [d for d in same_model if _matches(d, selection, namespace_prefix)]
        if namespace_prefix and not matching:
            elsewhere = [d for d in deployments if _matches(d, {}, namespace_prefix)]
            if elsewhere:
                raise ExplainError(
                    f"namespace {args.namespace!r} in store '{shown}' is "
                    f"{'of another model: ' + elsewhere[0].describe() if len(elsewhere) == 1 else 'ambiguous'}; "
                    f"give a namespace of the model in {args.model!r}")
        target = None
        if matching:
            target = max((lookups[d.digest] for d in matching),
                         key=lambda lk: (lk.hit_tokens, lk.held_tokens, lk.deployment.created))
        alternatives = []
        if target is not None:
            variants = []
            if salt is not None:
                variants.append((None, lora_dir))
            if lora_dir is not None:
                variants.append((salt, None))
            if salt is not None and lora_dir is not None:
                variants.append((None, None))
            alternatives = [look_up(store, target.deployment, token_ids, cache_salt=s, lora_dir=lo,
                                    min_hit_blocks=min_hit) for s, lo in variants]

    this = _namespace_fields(target.deployment.namespace) if target else {"model_fingerprint": fingerprint,
                                                                           **selection}
    others = [(lookups[d.digest], differences(this, d.namespace)) for d in deployments
              if target is None or d.digest != target.deployment.digest]
    others.sort(key=lambda o: (o[0].deployment.namespace.model_fingerprint != fingerprint,
                               -o[0].hit_tokens, -o[0].held_tokens, o[0].deployment.digest))
    notes = []
    if unreadable:
        notes.append(f"{_plural(unreadable, 'manifest')} in the store could not be read (`ucm store verify` "
                     f"says why); their namespaces were not looked at")
    if len(matching) > 1:
        notes.append(f"{len(matching)} namespaces of this model match; this is the one that holds the most of "
                     f"the prompt (--namespace, --dtype, --block-size, --tp-size or --kv-layout pick another)")
    return _conclude(args, shown, fingerprint, token_ids, selection, target, others, alternatives, same_model,
                     notes)


def _conclude(args, shown, fingerprint, token_ids, selection, target, others, alternatives, same_model,
              notes) -> Report:
    num_tokens = len(token_ids)
    if target is not None:
        block_size = target.block_size
        blocks = list(target.blocks)
        max_blocks = target.max_blocks
        hit = target.hit_blocks
    else:
        # No namespace of this engine: nothing is stored under it. Blocks are
        # counted in the selected block size, else in that of the namespace
        # holding the most of the prompt.
        candidates = [lk for lk, _ in others if lk.deployment in same_model] or [lk for lk, _ in others]
        block_size = selection.get("block_size") or (candidates[0].block_size if candidates else None)
        blocks = []
        max_blocks = 0
        if block_size:
            max_blocks = max(0, (num_tokens - 1) // block_size)
            blocks = [Block(i, i * block_size, (i + 1) * block_size, i < max_blocks, (), 1)
                      for i in range(num_tokens // block_size)]
        hit = 0
    first_miss = next((b for b in blocks if b.loadable and not b.stored), None)
    better = [(lk, diffs) for lk, diffs in others if lk.hit_tokens > hit * (block_size or 0)]

    def report(reason: str, message: str) -> Report:
        return Report(shown, args.model, fingerprint, num_tokens, args.cache_salt is not None, args.lora,
                      selection, target, block_size, blocks, max_blocks, hit, first_miss, reason, message,
                      others, alternatives, notes)

    if block_size and max_blocks == 0:
        return report("too_short", f"the prompt has no full block that a request could load "
                                   f"({_plural(num_tokens, 'token')}, block size {block_size}): a request "
                                   f"computes at least its last token, and only full blocks are stored")
    where = (f"block {first_miss.index} (tokens {first_miss.start}-{first_miss.end - 1})" if first_miss
             else "the first block")
    if target is None:
        if better:
            lk, diffs = better[0]
            kind = "other_namespace" if lk.deployment in same_model else "other_model"
            what = "no namespace of this model" if not same_model else \
                "no namespace of this model with " + ", ".join(f"{k.replace('_', ' ')} {v}"
                                                               for k, v in selection.items())
            return report(kind, f"the store holds {what}; namespace {lk.deployment.digest.hex()[:16]} "
                                f"({lk.deployment.describe()}) would load {lk.hit_tokens} tokens of this "
                                f"prompt, but differs in {_say_differences(diffs)}. Blocks are shared only "
                                f"within one namespace")
        if not same_model:
            models = {d.deployment.namespace.model_fingerprint for d, _ in others}
            return report("no_model", f"the store holds nothing for this model: no namespace manifest has its "
                                      f"fingerprint {fingerprint[:12]} (the store has manifests of "
                                      f"{_plural(len(models), 'other model')}); no engine serving these weights "
                                      f"and config saved here, or its manifests were removed")
        chosen = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in selection.items())
        return report("no_namespace", f"the store has {_plural(len(same_model), 'namespace')} of this model, none "
                                      f"with {chosen or 'the --namespace given'}, and none of them holds this "
                                      f"prompt's first block either")
    if first_miss is None:
        if target.leading_blocks > hit:
            return report("min_hit_blocks", f"{_plural(target.leading_blocks, 'leading block')} are stored, fewer "
                                            f"than --min-hit-blocks {args.min_hit_blocks}: the connector computes "
                                            f"them instead of loading them")
        return report("full_hit", f"every block a request could load is stored: it would load {hit * block_size} "
                                  f"tokens and compute the last {num_tokens - hit * block_size}")
    below_min = (f" (and the {_plural(target.leading_blocks, 'leading block')} before it are fewer than "
                 f"--min-hit-blocks {args.min_hit_blocks}, so none is loaded)"
                 if 0 < target.leading_blocks < args.min_hit_blocks else "")
    if first_miss.stored_ranks:
        missing = [r for r in range(first_miss.tp_size) if r not in first_miss.stored_ranks]
        return report("tp_shard_missing",
                      f"{where} is stored for TP rank {', '.join(map(str, first_miss.stored_ranks))} but not for "
                      f"rank {', '.join(map(str, missing))} of {first_miss.tp_size}: a request loads a block "
                      f"only when every rank's shard is there; the missing shards were evicted, deleted or never "
                      f"written{below_min}")
    later = [b for b in blocks[first_miss.index + 1:] if b.stored_ranks]
    if later:
        return report("evicted", f"{where} is not stored, but later block {later[0].index} of this prompt is: "
                                 f"it was saved once and has since been evicted or deleted (a bigger store, "
                                 f"or Redis's allkeys-lru, keeps more){below_min}")
    for alt in alternatives:
        if alt.hit_tokens > target.hit_tokens:
            missing = [name for name, given, used in (("cache_salt", target.with_salt, alt.with_salt),
                                                      ("lora", target.with_lora, alt.with_lora))
                       if given and not used]
            what = " and ".join("the cache_salt given" if m == "cache_salt" else "the LoRA adapter given"
                                for m in missing)
            return report("_and_".join(missing),
                          f"{where} is not stored with {what}, but without it the store holds "
                          f"{_plural(alt.hit_blocks, 'leading block')} ({alt.hit_tokens} tokens): the stored "
                          f"blocks were saved by requests without it, and a "
                          f"{'cache_salt' if missing[0] == 'cache_salt' else 'LoRA adapter'} changes every key"
                          f"{below_min}")
    if better:
        lk, diffs = better[0]
        kind = "other_namespace" if lk.deployment in same_model else "other_model"
        return report(kind, f"{where} is not stored under this namespace, but namespace "
                            f"{lk.deployment.digest.hex()[:16]} ({lk.deployment.describe()}) would load "
                            f"{lk.hit_tokens} tokens of this prompt; it differs in "
                            f"{_say_differences(diffs)}. Blocks are shared only within one namespace{below_min}")
    if first_miss.index == 0:
        hint = ("" if args.cache_salt is not None or args.lora is not None else
                "; if the requests carried a cache_salt or a LoRA adapter, give --cache-salt or --lora: "
                "they change every key")
        return report("diverges", f"{where} is not stored under this namespace or any other: no engine saved a "
                                  f"prompt that starts like this one, or it was evicted{hint}")
    return report("diverges", f"the prompt diverges at {where} from every prompt stored: blocks 0-"
                              f"{first_miss.index - 1} are stored, but no stored prompt continues with this "
                              f"block's tokens{below_min}")
