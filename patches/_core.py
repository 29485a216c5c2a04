"""What one patch is: a named replacement of one attribute of one vLLM class,
which checks what it replaces before touching it, and can be undone.

Also holds the one piece of state the patched functions read at call time:
the active hooks (a ``SparseMethod``), so that swapping methods never needs
re-patching.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable


class PatchError(RuntimeError):
    """vLLM is not what a patch was written for; nothing was patched."""


# The hooks the patched functions call; None = behave exactly like vLLM.
hooks: Any = None

# Model-runner steps begun since the process started (the step hook counts
# them): handed to every layer call as ``AttentionBatch.step``, so that a
# method tells a new step from the next layer of the same one without
# looking at tensor identities.
step_index: int = 0


def vllm_version() -> str:
    from vllm import version

    return str(version.__version__)


@dataclasses.dataclass
class Patch:
    """Replace ``module.owner.attr`` with ``make(original)``.

    ``params`` are the parameter names the original must start with (``self``
    included); ``versions`` the vLLM release series (``"0.32"``) it was
    written against; ``check_more`` returns further problems (attribute names
    the replacement reads), given the owner class.
    """

    name: str
    module: str
    owner: str
    attr: str
    params: tuple[str, ...]
    make: Callable[[Callable], Callable]
    versions: tuple[str, ...] = ("0.32", "0.33")
    check_more: Callable[[Any], list[str]] | None = None

    _owner_obj: Any = dataclasses.field(default=None, init=False, repr=False)
    _original: Any = dataclasses.field(default=None, init=False, repr=False)
    _had_own: bool = dataclasses.field(default=False, init=False, repr=False)
    _installed: bool = dataclasses.field(default=False, init=False, repr=False)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.owner}.{self.attr}"

    def problems(self, version: str) -> list[str]:
        """Everything that stops this patch from applying, as sentences."""
        series = ".".join(version.split(".")[:2])
        if series not in self.versions:
            supported = ", ".join(f"{v}.x" for v in self.versions)
            return [f"patch {self.name!r} supports vLLM {supported}; this is vLLM {version}"]
        try:
            owner = importlib.import_module(self.module)
            for part in self.owner.split("."):
                owner = getattr(owner, part)
        except (ImportError, AttributeError) as exc:
            return [f"patch {self.name!r}: {self.module}.{self.owner} not found in vLLM {version} ({exc})"]
        original = inspect.getattr_static(owner, self.attr, None)
        if original is None:
            return [f"patch {self.name!r}: {self.target} not found in vLLM {version}"]
        func = getattr(owner, self.attr)
        if getattr(func, "__ucm_patch__", None) is not None and not self._installed:
            return [f"patch {self.name!r}: {self.target} is already patched by another copy of ucm-connector"]
        if not self._installed:
            try:
                found = tuple(inspect.signature(func).parameters)
            except (TypeError, ValueError) as exc:
                return [f"patch {self.name!r}: cannot read the signature of {self.target} ({exc})"]
            if found[:len(self.params)] != self.params:
                return [f"patch {self.name!r}: {self.target} has parameters ({', '.join(found)}) in "
                        f"vLLM {version}; the patch expects ({', '.join(self.params)}, ...)"]
        more = self.check_more(owner) if self.check_more else []
        return [f"patch {self.name!r}: {p} (vLLM {version})" for p in more]

    def install(self) -> None:
        if self._installed:
            return
        owner = importlib.import_module(self.module)
        for part in self.owner.split("."):
            owner = getattr(owner, part)
        self._owner_obj = owner
        self._had_own = self.attr in vars(owner)
        self._original = vars(owner)[self.attr] if self._had_own else None
        original_func = getattr(owner, self.attr)
        replacement = self.make(original_func)
        replacement.__ucm_patch__ = self.name
        replacement.__wrapped__ = original_func
        setattr(owner, self.attr, replacement)
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        if self._had_own:
            setattr(self._owner_obj, self.attr, self._original)
        else:
            delattr(self._owner_obj, self.attr)
        self._installed = False
        self._owner_obj = self._original = None

    @property
    def installed(self) -> bool:
        return self._installed


def fields_missing(cls: Any, names: tuple[str, ...]) -> list[str]:
    """Dataclass fields (or class attributes) of ``cls`` that are not there."""
    have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    missing = [n for n in names if n not in have and not hasattr(cls, n)]
    return [f"{cls.__qualname__} has no field {n!r}" for n in missing]
