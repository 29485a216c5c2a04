"""Parsing helpers shared by the backends: store URLs, sizes, durations.

Errors name the URL (with any password masked) and what is wrong with it.

Passwords are masked by position in the text, not by what ``urlsplit``
makes of the URL: a password holding ``/``, ``?`` or ``#`` ends urlsplit's
host part early, so urlsplit's idea of the password is only a piece of it
(or nothing), and the rest would be printed.  ``mask_password`` hides
everything between the first ``:`` after ``://`` and the last ``@``, which
covers every way of reading the URL; ``split_url`` refuses the URLs whose
readings differ, so a store never opens something other than what its
URL's author meant.
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

#: The largest size any store option takes.  Far above any real disk or
#: memory, and far below where byte counts stop fitting in 64 bits.
MAX_NBYTES = 1 << 50
_MAX_NBYTES_TEXT = "1024TiB"
#: The longest duration any store option takes: longer ones are typos, and
#: socket and Redis timeouts overflow not much further on.
MAX_SECONDS = 365 * 24 * 3600
_MAX_SECONDS_TEXT = "8760h (a year)"

_ENDS_HOST_PART = "/?#"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _password_span(text: str) -> tuple[int, int] | None:
    """Where the password of a URL (or of any text holding one) lies:
    from just after the first ``:`` of the user part to the last ``@``.
    ``None`` when there is no ``user:password@``."""
    at = text.rfind("@")
    if at < 0:
        return None
    # The user part starts after the scheme's '://', unless that comes only
    # after the '@' (then the text has no scheme before its user part).
    sep = text.find("://")
    start = sep + 3 if 0 <= sep < at else 0
    colon = text.find(":", start, at)
    if colon < 0:
        return None
    return colon + 1, at


def mask_password(url: object) -> str:
    """The URL with its password replaced by ``***``; scheme, user name,
    host, path and options stay as written.  Never raises; idempotent.
    Works on any text that holds one URL (a ``repr`` of a value, say)."""
    text = url if isinstance(url, str) else str(url)
    span = _password_span(text)
    if span is None:
        return text
    return text[:span[0]] + "***" + text[span[1]:]


def split_url(url: str) -> urllib.parse.SplitResult:
    """``urlsplit(url)``, for a URL whose parts mean one thing only: a
    user name or password holding a character that ends the host part, a
    fragment, a control character or a malformed host is refused with a
    message that names the URL (password masked) and says how to write it."""
    shown = mask_password(url)
    span = _password_span(url)
    if span is not None:
        sep = url.find("://")
        userinfo = url[sep + 3 if 0 <= sep < span[1] else 0:span[1]]
        if any(c in userinfo for c in _ENDS_HOST_PART):
            raise StoreOpenError(
                f"store '{shown}': the part before '@' reads as user:password but holds '/', '?' or '#'; "
                f"percent-encode them in a user name or password (/ as %2F, ? as %3F, # as %23, @ as %40), "
                f"and write an '@' in a path or option value as %40")
    if _CONTROL.search(url):
        raise StoreOpenError(
            f"store {shown!r} holds a control character (a line break or a tab?); remove it, or "
            f"percent-encode it where it belongs to a path or value")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise StoreOpenError(f"store '{shown}' is malformed: {_why_malformed(str(exc))}") from None
    if "#" in url:
        raise StoreOpenError(
            f"store '{shown}': '#' starts a URL fragment, which store URLs do not take; "
            f"write a '#' in a path or option value as %23")
    return parts


def split_store_url(url: str, schemes: tuple[str, ...], *, credentials: bool = True,
                    example: str = "") -> urllib.parse.SplitResult:
    """``split_url(url)`` for a store class that opens the URLs of
    ``schemes`` (lower case): a URL of another scheme is refused, and so,
    where ``credentials`` is False, is one with a user name or password;
    the message names the URL (password masked) and shows ``example``."""
    parts = split_url(url)
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        names = [f"{s}://" for s in schemes]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise StoreOpenError(f"store '{mask_password(url)}' is not a {listed} URL")
    if not credentials and "@" in parts.netloc:
        raise StoreOpenError(
            f"store '{mask_password(url)}': {scheme}:// URLs take no user name or password; "
            f"write it like {example}")
    return parts


def _why_malformed(error: str) -> str:
    """What urlsplit's ValueError means, in words that quote nothing of the
    URL: its own texts quote the host part, which can hold a password."""
    if "Invalid IPv6 URL" in error:
        return "a '[' or ']' has no partner; write an IPv6 host in brackets, like [::1]:6379"
    if "IPv4 or IPv6 address" in error:
        return "the host in brackets is not an IPv6 address; write it like [::1]:6379"
    if "NFKC" in error:
        return ("the host part holds characters that Unicode folds into '/', '?', '#', '@' or ':'; "
                "write the host in ASCII and percent-encode the user name and password")
    return "it does not split into scheme, host, path and options"


def parse_size(text: str, *, url: str = "", name: str = "capacity") -> int:
    """``"20GiB"``, ``"512MB"``, ``"1048576"`` -> bytes."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        where = f"store '{mask_password(url)}': " if url else ""
        raise StoreOpenError(
            f"{where}{name}={text!r} is not a size; write it like 4GiB, 512MiB, 2GB or 1048576")
    # A float, not an int, so that a thousand-digit number costs nothing
    # (it becomes inf) and is refused below instead of overflowing.
    nbytes = float(m.group(1)) * _SIZE_UNITS[unit]
    if nbytes > MAX_NBYTES:
        where = f"store '{mask_password(url)}': " if url else ""
        raise StoreOpenError(
            f"{where}{name}={text!r} is more than {_MAX_NBYTES_TEXT}, the largest size a store option takes")
    return int(nbytes)


def parse_seconds(text: str, *, url: str = "", name: str) -> float:
    """``"2"``, ``"0.5"``, ``"250ms"``, ``"1h"`` -> seconds."""
    m = re.match(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|)\s*$", str(text))
    if not m:
        where = f"store '{mask_password(url)}': " if url else ""
        raise StoreOpenError(f"{where}{name}={text!r} is not a duration; write it like 2, 0.5, 250ms, 10m or 1h")
    scale = {"ms": 0.001, "s": 1, "": 1, "m": 60, "h": 3600}[m.group(2)]
    seconds = float(m.group(1)) * scale
    if seconds > MAX_SECONDS:
        where = f"store '{mask_password(url)}': " if url else ""
        raise StoreOpenError(
            f"{where}{name}={text!r} is longer than {_MAX_SECONDS_TEXT}, the longest a store option takes")
    return seconds


def parse_bool(text: str, *, url: str = "", name: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    where = f"store '{mask_password(url)}': " if url else ""
    raise StoreOpenError(f"{where}{name}={text!r} is not a boolean; write true or false")


#: CPU numbers at or past this are no CPU (Linux builds for at most 8192).
_MAX_CPUS = 1 << 16


def parse_cpus(text: str, *, url: str = "", name: str = "cpus") -> tuple[int, ...]:
    """A CPU list as ``taskset -c`` reads one (``2``, ``0-3``, ``1,3-5``):
    the CPU numbers, sorted."""
    cpus: set[int] = set()
    try:
        for part in str(text).split(","):
            first, _, last = part.strip().partition("-")
            lo = int(first)
            hi = int(last) if last else lo
            if lo < 0 or hi < lo or hi >= _MAX_CPUS:
                raise ValueError
            cpus.update(range(lo, hi + 1))
    except ValueError:
        cpus = set()
    if not cpus:
        where = f"store '{mask_password(url)}': " if url else ""
        raise StoreOpenError(f"{where}{name}={text!r} is not a CPU list; write it like 3, 2-3 or 0,2-3")
    return tuple(sorted(cpus))


def query_options(url: str, allowed: set[str]) -> dict[str, str]:
    """The URL's query as a dict; an option not in ``allowed`` or given
    twice is an error that names it."""
    parts = split_url(url)
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
