"""Redis store URLs: the options they take and what each must hold.

This module owns the parsing and checking of everything a Redis or Redis
Cluster URL says (namespace, ttl, timeout, pool bound, database, host and
port, the TLS files), so that a bad URL is an error that names the option
before any connection is tried.  It must not connect to a server or build
redis-py objects: it returns plain values for the stores to pass on.
"""

from __future__ import annotations

import dataclasses
import os
import re
import ssl
import urllib.parse

from ..base import StoreOpenError
from ..urls import mask_password, parse_bool, parse_seconds

DEFAULT_NAMESPACE = "ucm"
DEFAULT_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 10000  # Redis's default maxclients

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
COMMON_OPTIONS = frozenset({"namespace", "ttl", "timeout", "max_connections"})
SSL_OPTIONS = frozenset({"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"})
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


@dataclasses.dataclass(frozen=True)
class CommonOptions:
    """The options both Redis stores take (see the package docstring)."""

    namespace: str = DEFAULT_NAMESPACE
    ttl_s: float | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_connections: int | None = None


def common_options(url: str, options: dict[str, str]) -> CommonOptions:
    """The options both stores take, from a URL's query ``options``."""
    masked = mask_password(url)
    namespace = options.get("namespace", DEFAULT_NAMESPACE)
    if not _NAMESPACE_RE.match(namespace):
        raise StoreOpenError(
            f"store '{masked}': namespace={namespace!r} may use only letters, digits, '_', '.' and '-' "
            f"(1 to 128 of them)")
    ttl = None
    if options.get("ttl"):
        ttl = parse_seconds(options["ttl"], url=url, name="ttl")
        if ttl < 0.001:
            raise StoreOpenError(f"store '{masked}': ttl={options['ttl']!r} must be at least 1ms")
    timeout = DEFAULT_TIMEOUT_S
    if "timeout" in options:
        timeout = parse_seconds(options["timeout"], url=url, name="timeout")
        if timeout <= 0:
            raise StoreOpenError(f"store '{masked}': timeout must be more than 0")
    max_connections = None
    if options.get("max_connections"):
        text = options["max_connections"]
        # redis-py's blocking pool fills a queue with max_connections
        # slots up front: an absurd bound would take all memory.
        if not is_ascii_number(text) or not 1 <= int(text) <= MAX_CONNECTIONS:
            raise StoreOpenError(
                f"store '{masked}': max_connections={text!r} must be a whole number from 1 to {MAX_CONNECTIONS}")
        max_connections = int(text)
    return CommonOptions(namespace=namespace, ttl_s=ttl, timeout_s=timeout, max_connections=max_connections)


def host_port(url: str, parts: urllib.parse.SplitResult, default_port: int | None = 6379) -> tuple[str, int]:
    """The host and port of one server (``parts``: the URL, or one node of
    a cluster URL); ``default_port`` None: a port must be given."""
    masked = mask_password(url)
    host = parts.hostname
    if not host:
        raise StoreOpenError(f"store '{masked}' names no host: write it as redis://host:port/db")
    try:
        # The resolver's IDNA step raises UnicodeError (not a connection
        # error) on an empty or over-long label: say so before connecting.
        host.encode("idna")
    except UnicodeError:
        raise StoreOpenError(
            f"store '{masked}': {host!r} is not a host name (dot-separated labels of 1 to 63 characters)") from None
    try:
        port = parts.port
    except ValueError:
        raise StoreOpenError(
            f"store '{masked}': the port is not a number from 1 to 65535") from None
    if port is None:
        if default_port is None:
            raise StoreOpenError(f"store '{masked}': node {host!r} needs a port, as in {host}:6379")
        port = default_port
    if port == 0:
        raise StoreOpenError(f"store '{masked}': the port is not a number from 1 to 65535")
    return host, port


@dataclasses.dataclass(frozen=True)
class ClusterSeeds:
    """The nodes a ``redis-cluster://`` URL names, and its credentials."""

    nodes: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None


def cluster_seeds(url: str, netloc: str) -> ClusterSeeds:
    """``[user:password@]host:port[,host:port...]``: every node needs a port."""
    masked = mask_password(url)
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    nodes = []
    for item in hosts.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            node = urllib.parse.urlsplit("//" + item)
        except ValueError:
            # Only the first node's brackets were checked with the URL.
            raise StoreOpenError(
                f"store '{masked}': the node {item!r} is malformed; write it as host:port or "
                f"[IPv6]:port") from None
        nodes.append(host_port(url, node, default_port=None))
    if not nodes:
        raise StoreOpenError(
            f"store '{masked}' names no node: write it as redis-cluster://host:port[,host:port...]")
    return ClusterSeeds(nodes, username, password)


def is_ascii_number(text: str) -> bool:
    # str.isdigit also says yes to '²' (which int() refuses) and to other
    # scripts' digits (which int() reads); a thousand digits is no number
    # any option takes, and int() refuses 4300.
    return text.isascii() and text.isdigit() and len(text) <= 18


def parse_db(url: str, text: str) -> int:
    if not is_ascii_number(text):
        raise StoreOpenError(
            f"store '{mask_password(url)}': the database {text!r} is not a number; "
            f"write redis://host:port/0 (or ?db=0 for unix://)")
    return int(text)


def ssl_kwargs(url: str, options: dict[str, str]) -> dict[str, object]:
    """redis-py's TLS keyword arguments from the ``ssl_*`` options, each
    file checked (exists, readable, loads as PEM) now."""
    kwargs: dict[str, object] = {}
    if "ssl_cert_reqs" in options:
        value = options["ssl_cert_reqs"].lower()
        if value not in _CERT_REQS:
            raise StoreOpenError(
                f"store '{mask_password(url)}': ssl_cert_reqs={options['ssl_cert_reqs']!r}; "
                f"write none, optional or required")
        kwargs["ssl_cert_reqs"] = value
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in options:
            kwargs[name] = _tls_file(url, name, options[name])
    _load_tls_files(url, kwargs)
    if "ssl_check_hostname" in options:
        kwargs["ssl_check_hostname"] = parse_bool(options["ssl_check_hostname"], url=url,
                                                  name="ssl_check_hostname")
    return kwargs


def _tls_file(url: str, name: str, path: str) -> str:
    """A TLS file option's path, checked now: redis-py reads the files
    only once connected, and reports a missing one as a failure to connect
    (or, with no server there, not at all)."""
    problem = None
    if not os.path.exists(path):
        problem = "no such file"
    elif not os.path.isfile(path):
        problem = "not a file"
    elif not os.access(path, os.R_OK):
        problem = "not readable by this user"
    if problem:
        raise StoreOpenError(
            f"store '{mask_password(url)}': {name}={path!r}: {problem}"
            f"; give the path of a PEM file that the user running vLLM can read")
    return path


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for the
    # passphrase of an encrypted key; no option passes one to redis-py.
    raise StoreOpenError("an encrypted ssl_keyfile is not supported")


def _load_tls_files(url: str, kwargs: dict[str, object]) -> None:
    """Load the CA bundle and the client certificate as redis-py will, so
    that a file that is not PEM is named now, not reported as a server
    that cannot be reached."""
    masked = mask_password(url)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca = kwargs.get("ssl_ca_certs")
    if ca:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise StoreOpenError(
                f"store '{masked}': ssl_ca_certs={ca!r} holds no PEM certificate that loads "
                f"({getattr(exc, 'reason', None) or exc})") from None
    cert, key = kwargs.get("ssl_certfile"), kwargs.get("ssl_keyfile")
    if key and not cert:
        raise StoreOpenError(f"store '{masked}': ssl_keyfile is the key of ssl_certfile; give both")
    if cert:
        try:
            context.load_cert_chain(cert, key, password=_no_passphrase)
        except StoreOpenError:
            raise StoreOpenError(
                f"store '{masked}': ssl_keyfile={key or cert!r} is encrypted; give a key without a "
                f"passphrase") from None
        except (ssl.SSLError, OSError) as exc:
            raise StoreOpenError(
                f"store '{masked}': ssl_certfile={cert!r} (with ssl_keyfile={key!r}) does not load as a PEM "
                f"certificate and its key ({getattr(exc, 'reason', None) or exc})") from None
