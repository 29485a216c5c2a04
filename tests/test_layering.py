"""The layers keep to their side: the connector and the patches reach the
stores only through the stores' public API, and the stores know nothing of
the connector, vLLM or torch (DESIGN.md, "one place for each concern").

Read from the source (every import, at any depth of a module), so that an
import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The modules of ``store_backends`` that others may import: the package,
#: the contract and URL helpers every store shares, and each backend
#: package's top level.  What lies below a backend package (its layout,
#: wire format, options parser, server) is that store's own business.
PUBLIC_STORE_MODULES = frozenset({
    "store_backends", "store_backends.base", "store_backends.registry", "store_backends.urls",
    "store_backends.progress", "store_backends.tiered",
    "store_backends.disk", "store_backends.redis", "store_backends.shm",
})
#: Packages whose imported names must be in their ``__all__``.
_PACKAGES_WITH_ALL = ("store_backends", "store_backends.disk", "store_backends.redis", "store_backends.shm")


def _modules(package: str) -> list[tuple[str, str]]:
    """(dotted name, path) of every module of ``package``."""
    out = []
    base = os.path.join(ROOT, package)
    for directory, _, files in os.walk(base):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out.append((rel[:-len(".__init__")] if rel.endswith(".__init__") else rel, path))
    return out


def _imports(module: str, path: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import in a file; ``name`` None for
    ``import m``.  Relative imports are resolved against ``module``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                target = ".".join(anchor + ([target] if target else []))
            out += [(node.lineno, target, alias.name) for alias in node.names]
    return out


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _store_violation(module: str, name: str | None) -> str | None:
    """Why importing ``name`` from ``module`` (``name`` None: ``import
    module``) reaches past the stores' public API; None when it does not."""
    if module != "store_backends" and not module.startswith("store_backends."):
        return None
    if name is not None and _is_module(f"{module}.{name}"):
        module, name = f"{module}.{name}", None
    if any(part.startswith("_") for part in module.split(".")):
        return f"{module} is a private module"
    if module not in PUBLIC_STORE_MODULES:
        return f"{module} is a store's internal module"
    if name is None:
        return None
    if name.startswith("_"):
        return f"{name} is a private name of {module}"
    if module in _PACKAGES_WITH_ALL and name not in importlib.import_module(module).__all__:
        return f"{name} is not in {module}.__all__"
    return None


def _attribute_chains(path: str) -> list[tuple[int, str]]:
    """``store_backends.x.y`` written out in code (after ``import store_backends``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "store_backends":
                out.append((node.lineno, ".".join(["store_backends", *reversed(parts)])))
    return out


@pytest.mark.parametrize("package", ["ucm_connector", "patches"])
def test_the_connector_reaches_the_stores_only_through_their_public_api(package):
    problems = []
    for module, path in _modules(package):
        where = os.path.relpath(path, ROOT)
        for line, target, name in _imports(module, path):
            why = _store_violation(target, name)
            if why:
                problems.append(f"{where}:{line}: {why}")
        for line, chain in _attribute_chains(path):
            parts = chain.split(".")
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if _is_module(prefix):
                    why = _store_violation(prefix, None)
                elif parts[i - 1].startswith("_"):
                    why = f"{parts[i - 1]} is a private name of {'.'.join(parts[:i - 1])}"
                else:
                    continue
                if why:
                    problems.append(f"{where}:{line}: {why}")
                    break
    # A chain inside a longer one (a.b in a.b.c) is met twice: name it once.
    problems = list(dict.fromkeys(problems))
    assert not problems, "imports past the stores' public API:\n" + "\n".join(problems)


def test_the_stores_know_nothing_of_the_connector_vllm_or_torch():
    forbidden = ("ucm_connector", "patches", "vllm", "torch", "ucm_testing")
    problems = []
    for module, path in _modules("store_backends"):
        for line, target, _name in _imports(module, path):
            if target.split(".")[0] in forbidden:
                problems.append(f"{os.path.relpath(path, ROOT)}:{line}: imports {target}")
    assert not problems, "store_backends imports what it must not know:\n" + "\n".join(problems)


@pytest.mark.parametrize("package", ["ucm_connector", "store_backends", "patches"])
def test_the_product_never_imports_the_test_helpers(package):
    problems = [f"{os.path.relpath(path, ROOT)}:{line}: imports {target}"
                for module, path in _modules(package)
                for line, target, _name in _imports(module, path)
                if target.split(".")[0] in ("ucm_testing", "tests", "servers", "conftest")]
    assert not problems, "\n".join(problems)


def test_the_rule_catches_what_it_is_for():
    # The checker itself: each kind of reach past the API is named.
    assert _store_violation("store_backends.shm_server", "stop_server") == \
        "store_backends.shm_server is a store's internal module"
    assert _store_violation("store_backends.disk.layout", "INDEX_FILE") == \
        "store_backends.disk.layout is a store's internal module"
    assert _store_violation("store_backends.disk", "_MAGIC") == "_MAGIC is a private name of store_backends.disk"
    assert _store_violation("store_backends.redis", "_SlotMap") == "_SlotMap is a private name of store_backends.redis"
    assert _store_violation("store_backends", "shm_server") == "store_backends.shm_server is a store's internal module"
    assert _store_violation("store_backends.base", "check_batch") is None
    assert _store_violation("store_backends", "open_store") is None
    assert _store_violation("store_backends.disk", "is_disk_store") is None
