"""What a Redis failure means, in words an operator can act on.

This module owns the translation of redis-py's and the socket's errors into
the messages of ``StoreOpenError`` (at open) and ``StoreUnavailableError``
(in a call): which errors mean "server unreachable", how a wrong password
reads, and that a password never shows in a message.  It must not keep
connections or retry anything; the one call it makes is the open-time
``PING`` whose answer it explains.
"""

from __future__ import annotations

import socket
from typing import Callable

import redis as redis_py

from ..base import StoreOpenError

# A server that is down, unreachable or too slow (the call's deadline).
CONNECTION_ERRORS = (OSError, redis_py.exceptions.ConnectionError, redis_py.exceptions.TimeoutError)


def describe(exc: BaseException, password: str | None = None) -> str:
    """A library's error text, for a message.  None seen quotes the
    password, but a message must never show it, so it is cut out anyway
    (short ones would only garble the text: nobody guards with them)."""
    text = str(exc).strip() or type(exc).__name__
    if password and len(password) >= 4:
        text = text.replace(password, "***")
    if isinstance(exc, (socket.timeout, redis_py.exceptions.TimeoutError)) and "timed out" not in text:
        text = f"timed out ({text})"
    return text


def is_auth_error(text: str) -> bool:
    return any(mark in text for mark in ("NOAUTH", "WRONGPASS", "invalid password", "invalid username",
                                         "Authentication required", "AUTH <password>"))


def auth_message(masked: str, password: str | None) -> str:
    if password is None:
        return (f"store '{masked}': the server requires a password; put it in the URL as "
                f"redis://[user]:PASSWORD@host:port/db")
    return (f"store '{masked}': authentication failed (wrong user name or password); "
            f"check the credentials in the URL")


def ping(masked: str, client: redis_py.Redis, password: str | None, cleanup: Callable[[], None],
         where: str) -> None:
    """Open-time check of one server: it answers, the credentials and the
    database number are accepted.  Else ``cleanup()`` and ``StoreOpenError``
    saying which; ``where`` names the part of the URL to fix."""
    try:
        client.ping()
        return
    except redis_py.exceptions.AuthenticationError:
        message = auth_message(masked, password)
    except redis_py.exceptions.ResponseError as exc:
        text = describe(exc, password)
        if is_auth_error(text):
            message = auth_message(masked, password)
        elif "DB index" in text:
            message = f"store '{masked}': {text}; the server has fewer databases (see its 'databases' setting)"
        else:
            message = f"store '{masked}': the server refused the connection: {text}"
    except CONNECTION_ERRORS as exc:
        message = (f"store '{masked}' unreachable: {describe(exc, password)}; start redis-server there or fix "
                   f"{where} in the URL")
    except redis_py.exceptions.RedisError as exc:
        message = (f"store '{masked}': the server there does not answer like Redis ({describe(exc, password)}); "
                   f"check {where} in the URL")
    cleanup()
    raise StoreOpenError(message)


# What redis-py's RedisCluster constructor raises when no seed node helps.
CLUSTER_OPEN_ERRORS = (redis_py.exceptions.RedisError, redis_py.exceptions.RedisClusterException, OSError,
                       UnicodeError)


def cluster_open_message(masked: str, password: str | None, exc: BaseException) -> str:
    """Why a cluster could not be opened, from the error redis-py raised
    while loading the slot map from the seed nodes."""
    if isinstance(exc, redis_py.exceptions.AuthenticationError):
        return auth_message(masked, password)
    text = describe(exc, password)
    if is_auth_error(text):
        return auth_message(masked, password)
    if "cluster" in text.lower() and "not enabled" in text.lower():
        return (f"store '{masked}': the server there is not a Redis Cluster node ({text}); "
                f"use redis://host:port for a single server")
    return (f"store '{masked}' unreachable: {text}; check that the cluster nodes are up and that "
            f"host:port names at least one of them")
