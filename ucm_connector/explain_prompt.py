"""``ucm explain``'s inputs: the prompt as the token ids vLLM would see, and
the model as the fingerprint the connector puts in its namespaces.

Owns reading the prompt (``--prompt``, ``--prompt-file``, ``--token-ids``,
``-`` for stdin), tokenising it as vLLM does (the model's tokenizer, special
tokens added for a completion prompt; the chat template with ``--chat``),
and fingerprinting ``--model`` (the files, not the path).

What it must not do: open a store, or import vLLM or torch
(``transformers`` is imported only when text has to be tokenised).  Every
problem a user can fix is a ``UserError`` that says what to do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .cli.output import UserError


def _read_text(path: str, what: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None


def parse_token_ids(text: str, where: str) -> list[int]:
    """Token ids from a JSON list or from integers separated by spaces or commas."""
    stripped = text.strip()
    try:
        ids = (json.loads(stripped) if stripped.startswith("[")
               else [int(t) for t in stripped.replace(",", " ").split()])
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not a JSON list of token ids: {exc.msg} (line {exc.lineno}, "
                        f"column {exc.colno})") from None
    except ValueError as exc:
        raise UserError(f"{where}: not a list of token ids ({exc})") from None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise UserError(f"{where}: the JSON list must hold integers only")
    bad = [t for t in ids if not 0 <= t < 1 << 32]
    if bad:
        raise UserError(f"{where}: token id {bad[0]} is out of range (0 to 2**32 - 1)")
    if not ids:
        raise UserError(f"{where}: no token ids")
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
        raise UserError(f"cannot tokenise the prompt: {tokenizer_dir!r} is not a directory (give the model "
                        f"directory, --tokenizer DIR, or the prompt's --token-ids)")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise UserError(f"cannot tokenise the prompt without transformers ({exc}): pip install transformers, "
                        f"or give the prompt's --token-ids") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as exc:  # transformers raises many kinds for a broken directory
        raise UserError(f"cannot load the tokenizer in {tokenizer_dir!r}: {exc}") from None
    if not chat:
        # vLLM's completion prompts: the tokenizer's special tokens (BOS) added.
        return list(tokenizer.encode(text, add_special_tokens=True))
    try:
        rendered = tokenizer.apply_chat_template(_chat_messages(text), tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as exc:
        raise UserError(f"cannot apply the chat template of {tokenizer_dir!r}: {exc}") from None
    # The template writes the special tokens itself, so vLLM adds none.
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def prompt_token_ids(args: argparse.Namespace) -> list[int]:
    """The prompt's token ids, from whichever of ``--prompt``,
    ``--prompt-file`` and ``--token-ids`` was given."""
    if args.token_ids is not None:
        if args.chat:
            raise UserError("--chat applies to a text prompt; --token-ids are used as they are")
        return parse_token_ids(_read_text(args.token_ids, "token ids file"), f"token ids {args.token_ids!r}")
    text = args.prompt if args.prompt is not None else _read_text(args.prompt_file, "prompt file")
    if not text:
        raise UserError("the prompt is empty")
    return _tokenize(text, args.tokenizer or args.model, args.chat)


def model_identity(model: str, revision: str | None = None) -> str:
    """The model fingerprint the connector puts in its namespaces for
    ``--model`` and ``--revision`` (``hashing.model_identity``, as
    ``UserError`` where the files cannot be read), from ModelScope where
    ``VLLM_USE_MODELSCOPE`` is set, as vLLM takes it."""
    from .hashing import model_hub, model_identity as identity

    try:
        return identity(model, revision, hub=model_hub())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot fingerprint the model {model!r}: {exc}") from None
