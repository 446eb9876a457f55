"""Issue 28 item 9: a config file that ``config --set`` writes and ``from_env`` and the command read, shown with its source.

Before, the local cap lived only in a variable or a flag, so ``stats`` in another shell said ``no cap``.
"""

from __future__ import annotations

import functools
import json
import stat
from pathlib import Path

import pytest
from support import assert_one_line_error, run_cli_here

from tiered_progcache import settings
from tiered_progcache.config import CacheConfig


@pytest.fixture
def cli(capsys):
    """The command's main in this process (tests/support.py, run_cli_here): no interpreter start per run."""
    return functools.partial(run_cli_here, capsys)


ENV = settings.ENV_PREFIX
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _env(path: Path, node: Path) -> dict[str, str]:
    return {"TIERED_PROGCACHE_CONFIG": str(path), "TIERED_PROGCACHE_DIR": str(node)}


def test_set_then_another_shell_sees_the_cap_with_its_source(cli, tmp_path):
    path, node = tmp_path / "cfg" / "config", tmp_path / "node"
    env = _env(path, node)
    before = cli("stats", env={**env, "TIERED_PROGCACHE_CONFIG": ""})
    assert "(no cap)" in before.stdout
    wrote = cli("config", "--set", "max_local_bytes=10G", "--set", "wait_timeout=30", env=env)
    assert wrote.returncode == 0, wrote.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    shown = json.loads(cli("config", "--json", env=env).stdout)
    assert shown["max_local_bytes"] == {"value": 10**10, "source": f"file {path}"}
    assert shown["wait_timeout"] == {"value": 30.0, "source": f"file {path}"}
    stats = cli("stats", env=env)  # "another shell": a new process with only the file's path
    assert "of 9.3 GiB" in stats.stdout and "no cap" not in stats.stdout, stats.stdout
    flagged = json.loads(cli("config", "--json", "--max-local-bytes", "1G", env=env).stdout)
    assert flagged["max_local_bytes"] == {"value": 10**9, "source": "flag --max-local-bytes"}  # a flag wins
    variable = json.loads(cli("config", "--json", env={**env, ENV + "MAX_LOCAL_BYTES": "2G"}).stdout)
    assert variable["max_local_bytes"]["source"] == f"env {ENV}MAX_LOCAL_BYTES"  # so does a variable
    unset = cli("config", "--json", "--unset", "wait_timeout", env=env)
    assert json.loads(unset.stdout)["wait_timeout"] == {"value": 300.0, "source": "default"}


def test_from_env_reads_the_file_below_the_environment(tmp_path):
    path = tmp_path / "config"
    path.write_text("# mine\nmax_local_bytes = 10 G\n\nremote = s3://bucket/k\nstrict = yes\n")
    config = CacheConfig.from_env({"TIERED_PROGCACHE_CONFIG": str(path), ENV + "STRICT": "0"})
    assert (config.max_local_bytes, config.remote, config.strict) == (10**10, "s3://bucket/k", False)
    assert config.sources()["remote"] == f"file {path}" and config.sources()["strict"] == f"env {ENV}STRICT"
    xdg = tmp_path / "xdg"
    (xdg / "tiered-progcache").mkdir(parents=True)
    (xdg / "tiered-progcache" / "config").write_text("max_local_bytes = 5G\n")
    assert CacheConfig.from_env({"XDG_CONFIG_HOME": str(xdg)}).max_local_bytes == 5 * 10**9
    home = tmp_path / "home"
    (home / ".config" / "tiered-progcache").mkdir(parents=True)
    (home / ".config" / "tiered-progcache" / "config").write_text("max_local_bytes = 6G\n")
    assert CacheConfig.from_env({"HOME": str(home)}).max_local_bytes == 6 * 10**9
    assert CacheConfig.from_env({}) == CacheConfig()  # no path in the environment: no file


@pytest.mark.parametrize(("text", "match"), [
    ("max_local_bytes = lots\n", r":1: max_local_bytes: not a size"),
    ("# c\nwait_timeout = 1e10\n", r":2: wait_timeout: must be at most"),
    ("nosuch = 1\n", r":1: unknown setting 'nosuch'"),
    ("max_local_bytes 10G\n", r":1: not NAME = VALUE"),
    ("signing_key = x\n", r":1: signing_key: has no text form"),
])  # fmt: skip
def test_a_bad_line_names_the_file_the_line_and_the_setting(tmp_path, text, match):
    path = tmp_path / "config"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as raised:
        CacheConfig.from_env({"TIERED_PROGCACHE_CONFIG": str(path)})
    assert str(raised.value).startswith(str(path))


def test_a_named_file_that_is_missing_is_an_error_until_set_creates_it(cli, tmp_path):
    path = tmp_path / "absent"
    with pytest.raises(ValueError, match="^TIERED_PROGCACHE_CONFIG: no file"):
        CacheConfig.from_env({"TIERED_PROGCACHE_CONFIG": str(path)})
    env = _env(path, tmp_path / "node")
    assert "TIERED_PROGCACHE_CONFIG" in assert_one_line_error(cli("ls", env=env))
    assert cli("config", "--set", "max_local_bytes=1G", env=env).returncode == 0
    assert cli("ls", env=env).returncode == 0


def test_a_bad_set_is_refused_and_leaves_the_file_as_it_was(cli, tmp_path):
    path = tmp_path / "config"
    env = _env(path, tmp_path / "node")
    assert cli("config", "--set", "max_local_bytes=10 G", env=env).returncode == 0  # a spaced size, one value
    assert cli("config", "--set", "max_local_bytes=10", "G", env=env).returncode == 0  # also as two words
    assert CacheConfig.from_env({"TIERED_PROGCACHE_CONFIG": str(path)}).max_local_bytes == 10**10
    before = path.read_text()
    for bad, says in ((["--set", "max_local_bytes=lots"], "--set max_local_bytes: not a size"),
                      (["--set", "nosuch=1"], "unknown setting 'nosuch'"),
                      (["--set", "max_local_bytes"], "NAME=VALUE"),
                      (["--set", "lease_ttl=inf"], "lease_ttl"),
                      (["--unset", "nosuch"], "unknown setting")):  # fmt: skip
        assert says in assert_one_line_error(cli("config", *bad, env=env), 2)
    assert path.read_text() == before
    path.write_text(before + "wait_timeout = soon\n")  # a bad line: --set of that setting repairs it
    assert cli("config", "--set", "wait_timeout=30", env=env).returncode == 0
    assert CacheConfig.from_env({"TIERED_PROGCACHE_CONFIG": str(path)}).wait_timeout == 30.0


def test_a_url_password_set_in_the_file_is_never_printed(cli, tmp_path):
    env = _env(tmp_path / "config", tmp_path / "node")
    url = "redis://:PLANTED-CFG-PW-0009@127.0.0.1:6379/0"
    result = cli("config", "--set", f"remote={url}", env=env)
    assert result.returncode == 0 and "PLANTED-CFG-PW-0009" not in result.stdout + result.stderr


def test_configuration_md_gives_the_path():
    text = (DOCS / "configuration.md").read_text()
    assert "## The config file" in text
    assert "`$XDG_CONFIG_HOME/tiered-progcache/config`" in text and "`~/.config/tiered-progcache/config`" in text
    assert "`TIERED_PROGCACHE_CONFIG`" in text
