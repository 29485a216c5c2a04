"""The docs cannot drift from the code: every option, scheme, store option,
command, metric and quoted error message they name exists, and the
configuration reference is exactly what the code renders."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import re
import shlex
import tomllib

import pytest

from store_backends import StoreOpenError, known_schemes, open_store
from store_backends.registry import _BUILTIN as BUILTIN_SCHEMES
from ucm_connector.cli import build_parser, render_configuration_reference
from ucm_connector.config import OPTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def all_docs() -> dict[str, str]:
    texts = {"README.md": read("README.md")}
    for name in sorted(os.listdir(DOCS)):
        if name.endswith(".md"):
            texts[f"docs/{name}"] = read("docs", name)
    return texts


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n") + len(heading) + 1
    end = re.compile(r"^#{1,%d} " % level, re.M).search(text, start)
    return text[start:end.start() if end else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``text``, cells stripped."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif rows:
            break
    return [row for row in rows[2:]]


def code_name(cell: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected a `name` cell, got {cell!r}"
    return match.group(1)


# -- the configuration reference and README's options table ------------------------------

def test_configuration_reference_is_what_the_code_renders():
    assert read("docs", "configuration.md") == render_configuration_reference(), (
        "docs/configuration.md is out of date: regenerate it with "
        "`ucm config reference > docs/configuration.md`")


def test_readme_options_table_lists_exactly_the_options():
    rows = table_rows(section(read("README.md"), "### Connector options (`kv_connector_extra_config`)"))
    documented = [code_name(row[0]) for row in rows]
    assert sorted(documented) == sorted(o.name for o in OPTIONS)
    assert len(documented) == len(set(documented))
    defaults = {code_name(row[0]): row[1].strip("`") for row in rows}
    for option in OPTIONS:
        if option.default is not None:
            expected = str(option.default).lower() if isinstance(option.default, bool) else str(option.default)
            assert defaults[option.name] == expected, option.name


# -- store URLs ---------------------------------------------------------------------------

def scheme_sections() -> dict[str, str]:
    text = read("docs", "stores.md")
    return {m.group(1): section(text, m.group(0)) for m in re.finditer(r"^## `([a-z][a-z0-9+.-]*)://`$", text, re.M)}


def test_stores_doc_covers_exactly_the_builtin_schemes():
    documented = set(scheme_sections())
    assert documented == set(BUILTIN_SCHEMES)
    assert documented <= set(known_schemes())


def test_readme_store_table_names_only_existing_schemes():
    rows = table_rows(section(read("README.md"), "### Store URLs"))
    schemes = {code_name(row[0]).split("://")[0] for row in rows}
    assert schemes == set(BUILTIN_SCHEMES)


def accepted_options(url: str) -> set[str]:
    """The options a scheme's parser knows, from its own error for an unknown one."""
    with pytest.raises(StoreOpenError) as info:
        open_store(url + "?zz_not_an_option=1").close()
    match = re.search(r"unknown option 'zz_not_an_option' \(known options: ([^)]*)\)", str(info.value))
    assert match, str(info.value)
    return {name.strip() for name in match.group(1).split(",")}


def test_every_scheme_documents_exactly_the_options_it_accepts(tmp_path):
    probes = {
        "disk": f"disk://{tmp_path}/docs-probe",
        "redis": "redis://127.0.0.1:1/0",
        "rediss": "rediss://127.0.0.1:1/0",
        "unix": "unix:///nonexistent/redis.sock",
        "redis-cluster": "redis-cluster://127.0.0.1:1",
        "shm": "shm://docs-probe",
    }
    for scheme, text in scheme_sections().items():
        documented = {code_name(row[0]) for row in table_rows(text)}
        assert documented == accepted_options(probes[scheme]), scheme


# -- troubleshooting: every quoted message is one the code (or vLLM, or Python) writes ------

_PLACEHOLDER = re.compile(r"""[('"]?\.\.\.[)'"]?""")


def _source_texts() -> list[str]:
    roots = [os.path.join(ROOT, name) for name in ("ucm_connector", "store_backends", "patches")]
    vllm = importlib.util.find_spec("vllm")
    if vllm is not None and vllm.origin:
        roots.append(os.path.dirname(vllm.origin))
    stdlib = os.path.dirname(os.path.dirname(multiprocessing.__file__))
    roots += [os.path.join(stdlib, "multiprocessing"), os.path.join(stdlib, "importlib", "metadata")]
    texts = []
    for root in roots:
        for directory, _, files in os.walk(root):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                        texts.append(f.read())
    return texts


def test_every_message_in_troubleshooting_is_one_the_code_writes():
    headings = re.findall(r"^### `([^`]+)`$", read("docs", "troubleshooting.md"), re.M)
    assert len(headings) >= 20
    texts = _source_texts()
    missing = []
    for message in headings:
        pieces = [p.strip() for p in _PLACEHOLDER.split(message) if len(p.strip()) >= 8]
        assert pieces, f"heading {message!r} has no fixed text to look for"
        for piece in pieces:
            if not any(piece in text for text in texts):
                missing.append(f"{piece!r} (from {message!r})")
    assert not missing, "messages quoted in docs/troubleshooting.md that no code writes:\n" + "\n".join(missing)


# -- commands, metrics, install extras, links ---------------------------------------------------

def _subcommands() -> dict[str, set[str]]:
    parser = build_parser()
    groups = next(a for a in parser._actions if a.dest == "group").choices
    # A top-level command without subcommands (``ucm explain``) maps to an empty set.
    return {name: set(next((a.choices for a in p._actions if a.dest == "command"), None) or ())
            for name, p in groups.items()}


def test_every_ucm_command_in_the_docs_exists():
    commands = _subcommands()
    named = set()
    for where, text in all_docs().items():
        for group, command in re.findall(r"\bucm (store|config|shm) ([a-z]+)", text):
            assert command in commands[group], f"{where}: `ucm {group} {command}` does not exist"
            named.add((group, command))
    assert named == {(g, c) for g, cs in commands.items() for c in cs}, "a ucm command is not documented"


def _parse_ucm_line(parser, argv: list[str]) -> None:
    """Parse a `ucm` command line as `ucm` would."""
    parser.parse_args(argv)


def test_every_ucm_command_line_in_code_blocks_parses():
    parser = build_parser()
    for where, text in all_docs().items():
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S):
            for line in block.splitlines():
                for part in line.split(" | "):
                    part = re.split(r"\s+# ", part)[0].strip()
                    if not part.startswith("ucm ") or "'" in part and part.count("'") % 2:
                        continue
                    try:
                        _parse_ucm_line(parser, shlex.split(part)[1:])
                    except SystemExit:
                        pytest.fail(f"{where}: `{part}` is not a valid ucm command line")


def test_every_metric_named_in_the_docs_exists():
    # counters.TABLE names the counters' metrics; metrics.py any others.
    metrics = read("ucm_connector", "metrics.py") + read("ucm_connector", "counters.py")
    for where, text in all_docs().items():
        for name in re.findall(r"vllm:ucm_[a-z_]+", text):
            # Prometheus adds _total to a counter's name when it is exported.
            base = name[:-len("_total")] if name.endswith("_total") else name
            assert f'"{base}"' in metrics, f"{where}: metric {name} does not exist"


def test_install_extras_in_the_readme_exist():
    extras = tomllib.loads(read("pyproject.toml"))["project"]["optional-dependencies"]
    named = re.findall(r"ucm-connector\[([a-z0-9_-]+)\]", read("README.md"))
    assert {"cuda", "cpu"} <= set(named)
    assert set(named) <= set(extras)


def test_links_between_docs_point_at_files_that_exist():
    for where, text in all_docs().items():
        base = ROOT if where == "README.md" else DOCS
        for target in re.findall(r"\]\(([^)#]+\.md)\)", text):
            assert os.path.exists(os.path.join(base, target)), f"{where}: link to {target}"
