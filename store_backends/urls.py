"""Parsing helpers shared by the backends: store URLs, sizes, durations.

Errors name the URL (with any password masked) and what is wrong with it.
"""

from __future__ import annotations

import re
import urllib.parse

from .base import StoreOpenError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def mask_password(url: str) -> str:
    """The URL with the password of its user part replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = parts.netloc
    userinfo, _, hostport = netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))


def parse_size(text: str, *, url: str = "", name: str = "capacity") -> int:
    """``"20GiB"``, ``"512MB"``, ``"1048576"`` -> bytes."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        where = f"store '{mask_password(url)}': " if url else ""
        raise StoreOpenError(
            f"{where}{name}={text!r} is not a size; write it like 4GiB, 512MiB, 2GB or 1048576")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_seconds(text: str, *, url: str = "", name: str) -> float:
    """``"2"``, ``"0.5"``, ``"250ms"``, ``"1h"`` -> seconds."""
    m = re.match(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|)\s*$", str(text))
    if not m:
        where = f"store '{mask_password(url)}': " if url else ""
        raise StoreOpenError(f"{where}{name}={text!r} is not a duration; write it like 2, 0.5, 250ms, 10m or 1h")
    scale = {"ms": 0.001, "s": 1, "": 1, "m": 60, "h": 3600}[m.group(2)]
    return float(m.group(1)) * scale


def parse_bool(text: str, *, url: str = "", name: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    where = f"store '{mask_password(url)}': " if url else ""
    raise StoreOpenError(f"{where}{name}={text!r} is not a boolean; write true or false")


def query_options(url: str, allowed: set[str]) -> dict[str, str]:
    """The URL's query as a dict; an option not in ``allowed`` or given
    twice is an error that names it."""
    parts = urllib.parse.urlsplit(url)
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False)
    options: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise StoreOpenError(
                f"store '{mask_password(url)}': unknown option {name!r} (known options: {known})")
        if name in options:
            raise StoreOpenError(f"store '{mask_password(url)}': option {name!r} is given twice")
        options[name] = value
    return options
