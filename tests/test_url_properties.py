"""Properties of the store-URL parser and of password masking, over
generated input (hypothesis): no input makes them crash, show a password,
or accept a URL whose parts can be read two ways.

No example reaches a real host: redis URLs name 127.0.0.1 or [::1] on a
closed port with a short timeout, shm URLs say ``server=connect``, disk URLs
point into a temporary directory.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import urllib.parse

from hypothesis import HealthCheck, example, given, settings, strategies as st

from servers import free_port
from store_backends import StoreOpenError
from store_backends.registry import factory_for, url_scheme
from store_backends.urls import MAX_NBYTES, MAX_SECONDS, mask_password, parse_seconds, parse_size, \
    query_options, split_url

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLOSED_PORT = free_port()
SCRATCH = tempfile.mkdtemp(prefix="ucm-url-properties-")
atexit.register(shutil.rmtree, SCRATCH, True)

# The secret is fenced by markers that no other part of a generated URL can
# hold, so that any leaked piece of it (which holds one end or the other)
# is found in the output.
START, END = "Qz", "zQ"
FREE = st.characters(blacklist_characters="Qz", blacklist_categories=("Cs",))
ANY = st.characters(blacklist_categories=("Cs",))
DELIMITERS = "/?#@:%[]& "

user_names = st.text(FREE, max_size=8)
secret_bodies = st.text(st.one_of(st.sampled_from(DELIMITERS), ANY), min_size=0, max_size=12)
hosts = st.sampled_from(["127.0.0.1", "[::1]", "localhost"])


def _tail(scheme: str) -> str:
    return {
        "redis": "/0?timeout=0.3",
        "rediss": "/0?timeout=0.3",
        "unix": "/nonexistent/redis.sock?timeout=0.3",
        "redis-cluster": "?timeout=0.3",
        "disk": f"{SCRATCH}/store",
        "shm": "?server=connect",
    }[scheme]


def _url(scheme: str, user: str, secret: str, host: str) -> str:
    where = "" if scheme in ("unix", "disk") else f"{host}:{CLOSED_PORT}"
    if scheme == "shm":
        where = "ucmprop"
    return f"{scheme}://{user}:{secret}@{where}{_tail(scheme)}"


def _leaks(text: str) -> bool:
    return START in text or END in text


SCHEMES = st.sampled_from(["redis", "rediss", "unix", "redis-cluster", "disk", "shm"])


# -- masking ---------------------------------------------------------------------

@FAST
@given(st.text(ANY, max_size=60))
@example("redis://:a#b@h")
@example("u:p@h?x=a://b")
def test_masking_any_text_never_raises_and_a_second_masking_changes_nothing(text):
    once = mask_password(text)
    assert isinstance(once, str)
    assert mask_password(once) == once


@FAST
@given(SCHEMES, user_names, secret_bodies, hosts)
def test_a_masked_url_never_holds_any_piece_of_its_password(scheme, user, body, host):
    url = _url(scheme, user, START + body + END, host)
    shown = mask_password(url)
    assert not _leaks(shown)
    assert shown.startswith(f"{scheme}://")


@FAST
@given(SCHEMES, user_names.filter(lambda u: not set(u) & set("/?#@:")), secret_bodies, hosts)
def test_a_masked_url_keeps_the_user_the_host_and_the_path(scheme, user, body, host):
    url = _url(scheme, user, START + body + END, host)
    assert mask_password(url) == _url(scheme, user, "***", host)


# -- opening ---------------------------------------------------------------------

@FAST
@given(SCHEMES, user_names, secret_bodies, hosts)
def test_opening_a_url_with_a_password_fails_only_with_an_open_error_that_hides_it(scheme, user, body, host):
    url = _url(scheme, user, START + body + END, host)
    try:
        store = factory_for(url_scheme(url), url)(url)
    except StoreOpenError as exc:
        assert not _leaks(str(exc)), str(exc)
        return
    # Nothing listens on the closed port and disk:// and shm:// take no
    # password: a store that opens is a bug, but show what it would print.
    try:
        assert not _leaks(store.url) and not _leaks(repr(store)) and not _leaks(store.stats().url)
    finally:
        store.close()
    raise AssertionError(f"{mask_password(url)} opened")


@FAST
@given(SCHEMES, user_names, st.tuples(secret_bodies, st.sampled_from("/?#"), secret_bodies).map("".join), hosts)
def test_a_password_holding_a_delimiter_is_refused_before_anything_opens(scheme, user, body, host):
    url = _url(scheme, user, START + body + END, host)
    try:
        url_scheme(url)
    except StoreOpenError as exc:
        assert not _leaks(str(exc))
        return
    raise AssertionError(f"{mask_password(url)} was accepted")


@FAST
@given(st.sampled_from(["redis", "rediss", "redis-cluster"]), st.text(ANY, max_size=8),
       st.text(ANY, min_size=1, max_size=12), hosts)
def test_a_percent_encoded_user_and_password_come_back_exactly(scheme, user, secret, host):
    url = _url(scheme, urllib.parse.quote(user, safe=""), urllib.parse.quote(secret, safe=""), host)
    assert url_scheme(url) == scheme
    parts = split_url(url)
    assert urllib.parse.unquote(parts.username or "") == user
    assert urllib.parse.unquote(parts.password) == secret
    assert parts.hostname in ("127.0.0.1", "::1", "localhost")


@FAST
@given(SCHEMES, st.text(ANY, max_size=10))
def test_a_fragment_is_never_accepted(scheme, fragment):
    url = _url(scheme, "", "pw", "127.0.0.1").replace(":pw@", "") + "#" + fragment
    try:
        url_scheme(url)
    except StoreOpenError:
        return
    raise AssertionError(f"{url!r} was accepted")


@FAST
@given(st.text(ANY, max_size=40))
def test_splitting_any_text_after_a_scheme_raises_only_open_errors(rest):
    for scheme in ("redis", "disk"):
        try:
            parts = split_url(f"{scheme}://{rest}")
        except StoreOpenError as exc:
            assert "Traceback" not in str(exc)
            continue
        # What is accepted reads one way: no fragment, no control character.
        assert "#" not in rest and parts.scheme == scheme


@FAST
@given(st.text(ANY, max_size=40))
def test_options_of_any_query_parse_or_are_refused_by_name(query):
    try:
        options = query_options(f"redis://127.0.0.1:1/0?{query}", {"timeout", "ttl"})
    except StoreOpenError:
        return
    assert set(options) <= {"timeout", "ttl"}


# -- numbers ---------------------------------------------------------------------

SIZE_TEXT = st.one_of(
    st.text(ANY, max_size=20),
    st.from_regex(r"\A[0-9]{1,40}(\.[0-9]{1,8})?(|b|k|kb|m|mb|g|gb|t|tb|KiB|MiB|GiB|TiB)\Z"),
)
DURATION_TEXT = st.one_of(
    st.text(ANY, max_size=20),
    st.from_regex(r"\A[0-9]{1,40}(\.[0-9]{1,8})?(|ms|s|m|h)\Z"),
)


@FAST
@given(SIZE_TEXT)
@example("9" * 5000)
def test_a_size_is_a_byte_count_within_the_limit_or_refused(text):
    try:
        nbytes = parse_size(text, url="disk:///x", name="capacity")
    except StoreOpenError as exc:
        assert "capacity=" in str(exc)
        return
    assert isinstance(nbytes, int) and 0 <= nbytes <= MAX_NBYTES


@FAST
@given(DURATION_TEXT)
@example("9" * 5000 + "h")
def test_a_duration_is_within_the_limit_or_refused(text):
    try:
        seconds = parse_seconds(text, url="redis://h/0", name="ttl")
    except StoreOpenError as exc:
        assert "ttl=" in str(exc)
        return
    assert 0 <= seconds <= MAX_SECONDS


@FAST
@given(st.text(ANY, max_size=12), st.sampled_from(["db", "max_connections"]))
@example("\u00b2", "db")
@example("9" * 5000, "max_connections")
def test_a_redis_number_option_is_accepted_or_refused_by_name(text, option):
    url = (f"unix:///nonexistent/redis.sock?timeout=0.3&db={urllib.parse.quote(text)}" if option == "db"
           else f"redis://127.0.0.1:{CLOSED_PORT}/0?timeout=0.3&max_connections={urllib.parse.quote(text)}")
    try:
        factory_for(url_scheme(url), url)(url)
    except StoreOpenError as exc:
        assert option in str(exc) or "database" in str(exc) or "unreachable" in str(exc)
        return
    raise AssertionError(f"{url!r} opened with nothing listening")
