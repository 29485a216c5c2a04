"""Store URLs from careless or hostile input: passwords never shown, damaged
URLs refused with the fix, oversized numbers refused with the limit.

Nothing here reaches a real host: redis URLs name 127.0.0.1 or [::1] on a
closed port with a short timeout, and shm URLs say ``server=connect``.
"""

from __future__ import annotations

import os
import urllib.parse

import pytest

from servers import RedisServer, free_port
from store_backends import StoreOpenError, open_store
from store_backends.urls import mask_password, parse_seconds, parse_size
from ucm_connector import cli
from ucm_connector.config import UCMConfig, UCMConfigError

SECRET = "s3cret"


def closed_port() -> int:
    return free_port()


def open_error(url) -> str:
    """The message of the StoreOpenError that opening ``url`` raises."""
    with pytest.raises(StoreOpenError) as info:
        open_store(url)
    return str(info.value)


# -- masking ---------------------------------------------------------------------

@pytest.mark.parametrize("url, shown", [
    ("redis://user:s3cret@h:1/0", "redis://user:***@h:1/0"),
    ("redis://:s3cret@h:1/0", "redis://:***@h:1/0"),
    ("redis://:s3cret#x@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
    ("redis://:s3c/ret@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
    ("redis://:s3c?ret@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
    ("redis://:s3c@ret@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
    ("redis://:s3cret@[::1:1/0", "redis://:***@[::1:1/0"),
    ("rediss://u:s3cr%2Fet@[::1]:6380/2?timeout=1", "rediss://u:***@[::1]:6380/2?timeout=1"),
    ("redis-cluster://:s3cret@h1:1,h2:2", "redis-cluster://:***@h1:1,h2:2"),
    ("disk://u:s3cret@/x", "disk://u:***@/x"),
    ("shm://u:s3cret@name", "shm://u:***@name"),
    ("unix://:s3cret@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
    ("redis://:pässwört@h:1/0", "redis://:***@h:1/0"),
])
def test_the_whole_password_is_masked_and_the_rest_stays_readable(url, shown):
    assert mask_password(url) == shown


@pytest.mark.parametrize("url", [
    "redis://user@h:1/0", "disk:///var/cache/ucm", "disk:///home/me@corp/ucm", "shm://ucm?capacity=1GiB",
    "redis-cluster://h1:1,h2:2", "redis://h/0?ssl_ca_certs=/etc/me@corp/ca.pem", "nonsense", "",
])
def test_a_url_without_a_password_is_shown_as_written(url):
    assert mask_password(url) == url


def test_masking_twice_changes_nothing():
    once = mask_password("redis://u:a/b?c#d@h:1/0")
    assert mask_password(once) == once


# -- every message of opening a store --------------------------------------------

def leaky_urls() -> list[str]:
    port = closed_port()
    return [
        "redis://:s3cret#x@127.0.0.1:1/0",
        "redis://:s3c/ret@127.0.0.1:1/0",
        "redis://:s3c?ret@127.0.0.1:1/0",
        "redis://:s3cret@[::1:1/0",
        "redis://:s3cret@[zz]:1/0",
        "redis://:[s3cret]/x@127.0.0.1:1/0",
        f"redis://:s3cret@127.0.0.1:{port}/0?timeout=0.5",
        f"rediss://u:s3cret@127.0.0.1:{port}/0?timeout=0.5",
        f"unix://:s3cret@/nonexistent/redis.sock?timeout=0.5",
        f"redis-cluster://:s3cret@127.0.0.1:{port}?timeout=0.5",
        f"redis-cluster://:s3c/ret@127.0.0.1:{port}?timeout=0.5",
        "redis-cluster://:s3cret@",
        "redis-cluster://:s3cret@127.0.0.1:1,[zz]:2",
        "disk://u:s3cret@/x",
        "shm://u:s3cret@name?server=connect",
        "nosuch://:s3cret@h",
        "redis:/:s3cret@h",
    ]


@pytest.mark.parametrize("index", range(len(leaky_urls())))
def test_opening_never_shows_the_password(index):
    url = leaky_urls()[index]
    message = open_error(url)
    assert SECRET not in message and "s3c" not in message
    assert "***" in message


def test_a_non_string_store_is_named_without_its_password():
    message = open_error(b"redis://:s3cret@127.0.0.1:1/0")
    assert "bytes" in message and SECRET not in message


def test_a_bad_store_value_in_the_config_is_named_without_its_password():
    with pytest.raises(UCMConfigError) as info:
        UCMConfig.from_extra_config({"store": [{"url": "redis://:s3cret@127.0.0.1:1/0"}]})
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("url", [
    "redis://:s3cret#x@127.0.0.1:1/0",
    "redis://:s3c/ret@127.0.0.1:1/0",
    "redis://u:s3c?ret@127.0.0.1:1/0",
    "redis-cluster://:s3c/ret@127.0.0.1:1,127.0.0.1:2",
    "rediss://:s3c#ret@127.0.0.1:1/0",
])
def test_a_password_holding_a_delimiter_is_refused_with_how_to_write_it(url):
    message = open_error(url)
    assert "percent-encode" in message and "%2F" in message and "%23" in message
    assert SECRET not in message and "s3c" not in message


def test_a_percent_encoded_password_with_delimiters_reaches_the_server():
    password = "s3c/r?t#x@y:z"
    server = RedisServer(password=password).start()
    try:
        url = f"redis://:{urllib.parse.quote(password, safe='')}@127.0.0.1:{server.port}/0"
        with open_store(url) as store:
            assert store.put([b"k"], [b"v"]) == [True]
            assert store.get([b"k"]) == [b"v"]
            assert "s3c" not in store.url and "s3c" not in store.stats().url
    finally:
        server.cleanup()


# -- the ucm command -------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "redis://:s3cret#x@127.0.0.1:1/0",
    "redis://:s3c/ret@127.0.0.1:1/0",
    "disk://u:s3cret@/x",
    "shm://u:s3cret@name",
])
def test_ucm_store_stats_never_prints_the_password(url, capsys):
    status = cli.main(["store", "stats", url])
    out, err = capsys.readouterr()
    assert status != 0 and err.startswith("ucm: ")
    assert "s3c" not in out + err


@pytest.mark.parametrize("url", [
    "redis://:s3cret#x@127.0.0.1:1/0",
    "redis://:s3c/ret@127.0.0.1:1/0",
    "disk://u:s3cret@/x",
    "shm://u:s3cret@name",
])
def test_ucm_config_check_never_prints_the_password(url, capsys):
    import json

    status = cli.main(["config", "check", json.dumps({"store": url})])
    out, err = capsys.readouterr()
    assert status != 0
    assert "s3c" not in out + err


def test_ucm_config_check_of_a_reachable_redis_never_prints_the_password(capsys):
    import json

    server = RedisServer(password="s3cret").start()
    try:
        status = cli.main(["config", "check", json.dumps({"store": server.url})])
        out, err = capsys.readouterr()
    finally:
        server.cleanup()
    assert status == 0, err
    assert f"redis://:***@127.0.0.1:{server.port}/0" in out
    assert SECRET not in out + err


# -- damaged URLs ----------------------------------------------------------------

def test_a_disk_url_with_a_fragment_is_refused_before_any_directory_is_made(tmp_path):
    message = open_error(f"disk://{tmp_path}/dir#x")
    assert "'#'" in message and "%23" in message
    assert not os.path.exists(tmp_path / "dir")


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:1/0#x",
    "unix:///tmp/redis.sock#x",
    "redis-cluster://127.0.0.1:1#x",
    "shm://name?server=connect#x",
    "disk:///tmp/x?capacity=1GiB#x",
])
def test_every_scheme_refuses_a_fragment(url):
    assert "'#'" in open_error(url)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:1/\u00b2",
    "redis://127.0.0.1:1/\u0661",
    "redis://127.0.0.1:1/" + "9" * 5000,
    "unix:///tmp/redis.sock?db=\u00b2",
    "redis://127.0.0.1:1/0?max_connections=\u00b2",
    "redis://127.0.0.1:1/0?max_connections=" + "9" * 5000,
])
def test_numbers_that_are_not_plain_ascii_digits_are_refused(url):
    message = open_error(url)
    assert "not a number" in message or "whole number" in message


def test_a_huge_max_connections_is_refused_with_the_limit():
    message = open_error("redis://127.0.0.1:1/0?max_connections=99999999999")
    assert "max_connections" in message and "10000" in message


# -- oversized numbers -----------------------------------------------------------

@pytest.mark.parametrize("text", ["99999999999999999999999999TiB", "9" * 400, "9" * 400 + ".5GiB", "1025TiB"])
def test_an_oversized_size_is_refused_with_the_limit(text):
    with pytest.raises(StoreOpenError) as info:
        parse_size(text, url="disk:///x", name="capacity")
    assert f"capacity={text!r}" in str(info.value) and "1024TiB" in str(info.value)


def test_the_largest_size_is_accepted():
    assert parse_size("1024TiB") == 1 << 50


def test_an_oversized_capacity_is_refused_before_any_directory_is_made(tmp_path):
    message = open_error(f"disk://{tmp_path}/d?capacity=99999999999999999999999999TiB")
    assert "capacity" in message and "1024TiB" in message
    assert not os.path.exists(tmp_path / "d")


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:1/0?ttl=99999999999999999999h",
    "redis://127.0.0.1:1/0?timeout=" + "9" * 400,
    "shm://name?server=connect&timeout=9999999h",
    "disk://{tmp}/d?touch_interval=99999999999999h",
])
def test_an_oversized_duration_is_refused_with_the_limit(url, tmp_path):
    assert "8760h" in open_error(url.format(tmp=tmp_path))
    assert not os.path.exists(tmp_path / "d")


def test_the_longest_duration_is_accepted():
    assert parse_seconds("8760h", name="ttl") == 365 * 24 * 3600


@pytest.mark.parametrize("host", ["a" * 64, "a..b"])
def test_a_host_name_the_resolver_cannot_take_is_refused_before_connecting(host):
    message = open_error(f"redis://{host}:1/0?timeout=0.5")
    assert f"{host!r} is not a host name" in message


# -- TLS files -------------------------------------------------------------------

@pytest.mark.parametrize("option", ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile"])
def test_a_missing_tls_file_is_named_not_reported_as_unreachable(option, tmp_path):
    missing = tmp_path / "missing.pem"
    message = open_error(f"rediss://127.0.0.1:{closed_port()}/0?{option}={missing}&timeout=0.5")
    assert f"{option}='{missing}'" in message and "no such file" in message
    assert "unreachable" not in message


def test_a_tls_file_that_is_not_pem_is_named(tmp_path):
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    message = open_error(f"rediss://127.0.0.1:{closed_port()}/0?ssl_ca_certs={junk}&timeout=0.5")
    assert f"ssl_ca_certs='{junk}'" in message and "PEM" in message
    assert "unreachable" not in message


def test_a_cluster_with_a_missing_tls_file_names_it(tmp_path):
    missing = tmp_path / "missing.pem"
    message = open_error(f"redis-cluster://127.0.0.1:{closed_port()}?ssl=true&ssl_ca_certs={missing}&timeout=0.5")
    assert f"ssl_ca_certs='{missing}'" in message and "unreachable" not in message


def test_an_encrypted_client_key_is_refused_without_prompting(tmp_path):
    import subprocess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=ucm-test", "-passout", "pass:s3cret"],
                   check=True, capture_output=True, stdin=subprocess.DEVNULL)
    message = open_error(f"rediss://127.0.0.1:{closed_port()}/0?ssl_certfile={cert}&ssl_keyfile={key}&timeout=0.5")
    assert "is encrypted" in message and "unreachable" not in message


def test_a_client_certificate_and_key_that_load_reach_the_connection(tmp_path):
    import subprocess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=ucm-test"],
                   check=True, capture_output=True, stdin=subprocess.DEVNULL)
    message = open_error(f"rediss://127.0.0.1:{closed_port()}/0?ssl_certfile={cert}&ssl_keyfile={key}"
                         f"&ssl_ca_certs={cert}&timeout=0.5")
    assert "unreachable" in message
