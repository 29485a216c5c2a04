"""``ucm explain``: why a prompt would (partly) miss the store, block by block.

Owns the command's arguments, its exit status and the explanation's
course (open the store, look the prompt up under every namespace, choose
the one that is this engine's); ``ucm`` registers it as a command
(``SUMMARY``, ``HELP``, ``add_arguments``, ``run``).  The pieces it puts
together: ``explain_prompt`` (the prompt's token ids, the model's
fingerprint), ``explain_lookup`` (namespaces from manifests, what each
holds of the prompt), ``explain_reasons`` (the first miss and its reason)
and ``explain_report`` (the report, as text or JSON).

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
when the command runs, only to tokenise text), change the store (it is opened with
``OpenMode.INSPECT``: nothing is evicted, no server is started; keys are
listed and asked ``contains``, manifests are peeked), or print a password
(store URLs are masked; cache_salt values are never printed).

It sees a namespace only through its manifest, which every saving engine
rank writes when it starts; blocks whose manifest is gone are not looked at
(``ucm store stats`` lists them by digest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from store_backends import OpenMode, mask_password, open_store

from .cli.output import EXIT_OK, EXIT_PROBLEMS, UserError, plural
from .hashing import adapter_files

if TYPE_CHECKING:
    from .explain_lookup import Deployment
    from .explain_report import Report

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
    parser.add_argument("--revision", metavar="REV",
                        help="the --revision the engines were started with, for a hub model name without local "
                             "files (a local directory is known by its files)")
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
    from .cli import run_command

    return run_command(_explain_and_print, args)


def _explain_and_print(args: argparse.Namespace) -> int:
    try:
        report = explain(args)
    except OSError as exc:
        # An unexpected I/O error still gets one line, never a password.
        raise UserError(mask_password(str(exc))) from None
    try:
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            sys.stdout.write(report.render())
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK if report.reason in ("full_hit", "too_short") else EXIT_PROBLEMS


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
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.min_hit_blocks < 0:
        raise UserError(f"--min-hit-blocks must be 0 or more, got {args.min_hit_blocks}")
    if args.lora is not None:
        try:
            adapter_files(args.lora)
        except FileNotFoundError as exc:
            raise UserError(f"--lora: {exc}") from None
    prefix = args.namespace.strip().lower() if args.namespace else None
    if prefix is not None and (len(prefix) < 4 or any(c not in "0123456789abcdef" for c in prefix)):
        raise UserError(f"--namespace {args.namespace!r}: give a namespace digest or 4+ of its leading hex "
                        f"digits, as `ucm store stats` prints them")
    return prefix


def explain(args: argparse.Namespace) -> Report:
    """Open the store read-only and build the report (no output)."""
    # Imported here, not above: ``ucm``'s parser imports this module to
    # register the command, and these import ``ucm_connector.cli``.
    from .explain_lookup import differences, find_deployments, look_up, namespace_fields
    from .explain_prompt import model_identity, prompt_token_ids
    from .explain_reasons import conclude
    from .explain_report import Findings

    namespace_prefix = _check_args(args)
    urls = [url.strip() for url in args.store]
    shown = ", ".join(mask_password(url) for url in urls)
    fingerprint = model_identity(args.model, args.revision)
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
                raise UserError(
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

    this = namespace_fields(target.deployment.namespace) if target else {"model_fingerprint": fingerprint,
                                                                           **selection}
    others = [(lookups[d.digest], differences(this, d.namespace)) for d in deployments
              if target is None or d.digest != target.deployment.digest]
    others.sort(key=lambda o: (o[0].deployment.namespace.model_fingerprint != fingerprint,
                               -o[0].hit_tokens, -o[0].held_tokens, o[0].deployment.digest))
    notes = []
    if unreadable:
        notes.append(f"{plural(unreadable, 'manifest')} in the store could not be read (`ucm store verify` "
                     f"says why); their namespaces were not looked at")
    if len(matching) > 1:
        notes.append(f"{len(matching)} namespaces of this model match; this is the one that holds the most of "
                     f"the prompt (--namespace, --dtype, --block-size, --tp-size or --kv-layout pick another)")
    return conclude(Findings(
        store=shown, model=args.model, model_fingerprint=fingerprint, num_tokens=len(token_ids),
        cache_salt_given=salt is not None, lora=lora_dir, min_hit_blocks=min_hit, selection=selection,
        target=target, others=others, alternatives=alternatives, same_model=same_model, notes=notes))


def _normalize_dtype(dtype: str) -> str:
    dtype = dtype.strip().lower()
    dtype = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(dtype, dtype)
