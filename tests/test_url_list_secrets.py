"""Issue 28 item 17: no password of a remote list reaches an error, stderr, a log or a repr, whatever the list's shape.

A comma inside a password or a query (``redis://:ab,cdPW@h/0``, ``?password=ab,cd``) stays in
its URL; a trailing comma, two commas in a row, or a URL given twice is refused without echoing
the list; the same through the variable, the command and ``TieredProgramCache(remote=[u, u])``.
"""

from __future__ import annotations

import functools
import logging

import pytest
from support import run_cli_here

from tiered_progcache import CacheConfig, TieredProgramCache


@pytest.fixture
def cli(capsys):
    """The command's main in this process (tests/support.py, run_cli_here): no interpreter start per run."""
    return functools.partial(run_cli_here, capsys)


PW = "PLANTEDab,cdPW0017"  # a comma inside the password
PIECES = ("PLANTEDab", "cdPW0017", PW)

USERINFO = f"redis://:{PW}@127.0.0.1:6379/0"
QUERY = f"redis://127.0.0.1:6379/0?password={PW}"
S3 = "s3://bucket/kernels"


def _leaks(text: str) -> list[str]:
    return [piece for piece in PIECES if piece in text]


@pytest.mark.parametrize("url", [USERINFO, QUERY], ids=["userinfo", "query"])
def test_a_comma_inside_a_password_stays_in_its_url(url):
    assert CacheConfig.from_env({"TIERED_PROGCACHE_REMOTE": url}).remote == url
    assert CacheConfig.from_env({"TIERED_PROGCACHE_REMOTE": f"{url},{S3}"}).remote == (url, S3)
    assert CacheConfig.from_env({"TIERED_PROGCACHE_REMOTE": f"{S3}, {url}"}).remote == (S3, url)
    assert _leaks(repr(CacheConfig.from_env({"TIERED_PROGCACHE_REMOTE": f"{url},{S3}"}))) == []


MALFORMED = {
    "trailing comma": f"{USERINFO},",
    "trailing comma after a query": f"{QUERY},",
    "two commas": f"{USERINFO},,{S3}",
    "leading comma": f",{USERINFO}",
    "twice": f"{USERINFO},{USERINFO}",
    "twice by query": f"{QUERY},{S3},{QUERY}",
}


@pytest.mark.parametrize("text", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_list_is_refused_without_its_passwords(text, caplog):
    with caplog.at_level(logging.DEBUG), pytest.raises(ValueError) as raised:
        CacheConfig.from_env({"TIERED_PROGCACHE_REMOTE": text})
    message = str(raised.value)
    assert message.startswith("TIERED_PROGCACHE_REMOTE: ")
    assert "comma" in message or "twice" in message  # it says what to fix
    assert _leaks(message + repr(raised.value) + caplog.text) == []


@pytest.mark.parametrize("url", [USERINFO, QUERY], ids=["userinfo", "query"])
def test_a_url_given_twice_to_the_constructor_is_refused_without_its_password(tmp_path, url):
    for remote in ([url, url], (url, S3, url)):
        with pytest.raises(ValueError, match="twice") as raised:
            TieredProgramCache(tmp_path, remote=remote)
        assert _leaks(str(raised.value) + repr(raised.value)) == []
        assert "***" in str(raised.value)  # masked, not dropped: the reader sees which URL


@pytest.mark.parametrize("text", [*MALFORMED.values(), f"{USERINFO},{S3}"],
                         ids=[*MALFORMED.keys(), "good list"])  # fmt: skip
def test_the_command_prints_no_password_of_any_list(cli, tmp_path, text):
    for args in (["config", "--json"], ["ls", "-v"]):
        result = cli(*args, env={"TIERED_PROGCACHE_REMOTE": text, "TIERED_PROGCACHE_DIR": str(tmp_path)})
        assert _leaks(result.stdout + result.stderr) == [], (args, result.stdout, result.stderr)


@pytest.mark.parametrize("text", [f":{PW}@127.0.0.1:6379/0", f"redis:/:{PW}@127.0.0.1/0", f"redis:{PW}@h/0",
                                  f"{S3},redis:/:{PW}@h/0"])  # fmt: skip
def test_a_url_missing_its_scheme_is_refused_without_its_password(text):
    with pytest.raises(ValueError, match="no scheme") as raised:
        CacheConfig.from_env({"TIERED_PROGCACHE_REMOTE": text})
    assert _leaks(str(raised.value)) == [] and "***@" in str(raised.value)
