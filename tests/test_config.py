"""CacheConfig: environment parsing, precedence, sources, bad values naming their variable, build()."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from tiered_progcache import DEFAULT_MAX_MEMORY_BYTES, TieredProgramCache
from tiered_progcache.config import CacheConfig, parse_size
from tiered_progcache.envelope import EnvelopeCodec
from tiered_progcache.localdir import entry_name

ENV = "TIERED_PROGCACHE_"


def test_defaults_with_an_empty_environment():
    config = CacheConfig.from_env({})
    assert config == CacheConfig()
    assert config.max_memory_bytes == DEFAULT_MAX_MEMORY_BYTES and config.remote is None
    assert set(config.sources().values()) == {"default"}


def test_every_variable_is_read(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(b"k" * 32)
    key_file.chmod(0o600)
    environ = {
        ENV + "DIR": str(tmp_path / "cache"),
        ENV + "MAX_MEMORY_BYTES": "256M",
        ENV + "MAX_LOCAL_BYTES": "10Gi",
        ENV + "REMOTE": "s3://bucket/kernels",
        ENV + "REMOTE_OPTIONS": '{"endpoint_url": "http://127.0.0.1:9000", "anon": true}',
        ENV + "READ_ONLY": "true",
        ENV + "SIGNING_KEY_FILE": str(key_file),
        ENV + "COMPRESSION": "zstd",
        ENV + "REMOTE_TIMEOUT": "2.5",
        ENV + "STRICT": "1",
        ENV + "MAX_PENDING_UPLOADS": "64",
    }
    config = CacheConfig.from_env(environ)
    assert config.local_dir == tmp_path / "cache"
    assert (config.max_memory_bytes, config.max_local_bytes) == (256_000_000, 10 * 2**30)
    assert config.remote == "s3://bucket/kernels"
    assert config.remote_options == {"endpoint_url": "http://127.0.0.1:9000", "anon": True}
    assert (config.remote_read_only, config.strict, config.compression) == (True, True, "zstd")
    assert (config.signing_key_file, config.remote_timeout, config.max_pending_uploads) == (key_file, 2.5, 64)
    sources = config.sources()
    assert sources["remote"] == "env TIERED_PROGCACHE_REMOTE"
    assert sources["remote_read_only"] == "env TIERED_PROGCACHE_READ_ONLY"
    assert all(where.startswith("env ") for where in sources.values())


def test_arguments_beat_the_environment_and_empty_variables_are_unset():
    environ = {ENV + "REMOTE": "s3://from-env/x", ENV + "READ_ONLY": "", ENV + "MAX_LOCAL_BYTES": "1G"}
    config = CacheConfig.from_env(environ, remote="gs://from-arg/x", max_local_bytes=None)
    assert config.remote == "gs://from-arg/x" and config.max_local_bytes is None
    assert config.sources()["remote"] == "argument" and config.sources()["max_local_bytes"] == "argument"
    assert config.sources()["remote_read_only"] == "default" and config.remote_read_only is False


@pytest.mark.parametrize(
    "text, expected",
    [("4096", 4096), ("10G", 10**10), ("256M", 256 * 10**6), ("10Gi", 10 * 2**30), ("1.5Ki", 1536), (" 2 mib ", 2 << 20)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_unlimited_sizes():
    assert CacheConfig.from_env({ENV + "MAX_MEMORY_BYTES": "none"}).max_memory_bytes is None


@pytest.mark.parametrize(
    "variable, value",
    [
        ("MAX_MEMORY_BYTES", "-1"),
        ("MAX_MEMORY_BYTES", "0"),
        ("MAX_LOCAL_BYTES", "10 parsecs"),
        ("REMOTE", "nosuchscheme://bucket/x"),
        ("REMOTE_OPTIONS", "{not json"),
        ("REMOTE_OPTIONS", '["a", "list"]'),
        ("READ_ONLY", "maybe"),
        ("STRICT", "2"),
        ("COMPRESSION", "gzip"),
        ("REMOTE_TIMEOUT", "-3"),
        ("REMOTE_TIMEOUT", "soon"),
        ("REMOTE_TIMEOUT", "inf"),
        ("MAX_PENDING_UPLOADS", "0"),
    ],
)
def test_bad_values_name_their_variable(variable, value):
    with pytest.raises(ValueError, match=f"^{ENV}{variable}: "):
        CacheConfig.from_env({ENV + variable: value})


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"max_local_bytes": -5}, "^max_local_bytes: "),
        ({"remote_timeout": 0}, "^remote_timeout: "),
        ({"remote_options": "[1]"}, "^remote_options: "),
        ({"remote": "ftpx://x"}, "^remote: "),
    ],
)
def test_bad_arguments_name_their_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig.from_env({}, **overrides)


def test_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="remote_url"):
        CacheConfig.from_env({}, remote_url="s3://x/y")


def test_build_makes_the_configured_chain(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(b"signing key\n")
    key_file.chmod(0o600)
    url = f"memory://config-{uuid.uuid4().hex}/kernels"
    environ = {
        ENV + "DIR": str(tmp_path / "local"),
        ENV + "REMOTE": url,
        ENV + "SIGNING_KEY_FILE": str(key_file),
        ENV + "MAX_LOCAL_BYTES": "1M",
    }
    with TieredProgramCache.from_env(environ) as cache:
        assert [t.name for t in cache.tiers] == ["memory", "local", "remote"]
        assert cache.local_dir == tmp_path / "local"
        cache[b"k"] = b"v"
        assert cache.flush(timeout=10)
        remote = cache.remote
        blob = remote.fs.cat_file(remote.path_for(entry_name(b"k")))
    assert EnvelopeCodec(b"signing key").open(entry_name(b"k"), blob) == b"v"  # key file read, newline stripped


def test_build_from_env_reads_os_environ(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV + "DIR", str(tmp_path / "from-os-environ"))
    with TieredProgramCache.from_env() as cache:
        assert cache.local_dir == tmp_path / "from-os-environ"
        assert cache.remote is None


def test_signing_key_file_problems_name_the_variable(tmp_path, caplog):
    missing = {ENV + "REMOTE": "memory://k/x", ENV + "SIGNING_KEY_FILE": str(tmp_path / "absent")}
    with pytest.raises(ValueError, match=f"^{ENV}SIGNING_KEY_FILE: cannot read"):
        CacheConfig.from_env(missing).build()
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        CacheConfig.from_env({}, signing_key_file=empty).build()
    shared = tmp_path / "shared"
    shared.write_bytes(b"k")
    shared.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.config"):
        CacheConfig.from_env({}, local_dir=tmp_path / "d", signing_key_file=shared).build().close()
    assert "readable by others" in caplog.text


def test_local_dir_expands_user(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert CacheConfig.from_env({ENV + "DIR": "~/kernels"}).local_dir == Path(tmp_path, "kernels")


def test_signing_key_file_keeps_binary_whitespace_and_drops_one_newline(tmp_path):
    from tiered_progcache.config import CacheConfig

    binary = tmp_path / "binary.key"
    binary.write_bytes(b" \x00key\t")
    binary.chmod(0o600)
    text = tmp_path / "text.key"
    text.write_bytes(b"deadbeef\n")
    text.chmod(0o600)
    env = {"TIERED_PROGCACHE_DIR": str(tmp_path / "d")}
    assert CacheConfig.from_env({**env, "TIERED_PROGCACHE_SIGNING_KEY_FILE": str(binary)})._signing_key() == b" \x00key\t"
    assert CacheConfig.from_env({**env, "TIERED_PROGCACHE_SIGNING_KEY_FILE": str(text)})._signing_key() == b"deadbeef"
