"""CacheConfig and the settings table: environment parsing, precedence, sources, bad values naming
their variable, the command's options, build(), and that a new setting is one row of the table."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import uuid
from pathlib import Path

import pytest
from cuda.core.utils import InMemoryProgramCache

from tiered_progcache import DEFAULT_MAX_MEMORY_BYTES, EntryRejected, TieredProgramCache, settings
from tiered_progcache.config import CacheConfig
from tiered_progcache.stores.remote import RemoteProgramCache
from tiered_progcache.units import parse_size

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
        ENV + "CREATE_REMOTE_ROOT": "yes",
        ENV + "REDIS_EXPIRE_S": "3600",
        ENV + "MAX_PENDING_UPLOADS": "64",
        ENV + "MAX_PENDING_UPLOAD_BYTES": "64Mi",
        ENV + "TRANSFER_CONCURRENCY": "16",
        ENV + "MIN_UPLOAD_COMPILE_S": "0.5",
        ENV + "EXPLAIN": "1",
        ENV + "LEASE_MIN_COMPILE_RTTS": "6",
        ENV + "WAIT_PATIENCE": "none",
        ENV + "COMPILE_TIME_PRIOR_S": "0.3",
        ENV + "EXIT_TIMEOUT": "4.5",
        ENV + "SINGLE_FLIGHT": "0",
        ENV + "WAIT_TIMEOUT": "30",
        ENV + "LEASE_TTL": "20",
        ENV + "HEADER_RECHECK_S": "2",
        ENV + "PORTABLE_KEYS": "off",
    }
    config = CacheConfig.from_env(environ)
    assert config.local_dir == tmp_path / "cache"
    assert (config.max_memory_bytes, config.max_local_bytes) == (256_000_000, 10 * 2**30)
    assert config.remote == "s3://bucket/kernels"
    assert config.remote_options == {"endpoint_url": "http://127.0.0.1:9000", "anon": True}
    assert (config.remote_read_only, config.strict, config.compression) == (True, True, "zstd")
    assert (config.signing_key_file, config.remote_timeout, config.max_pending_uploads) == (key_file, 2.5, 64)
    assert config.max_pending_upload_bytes == 64 << 20
    assert config.transfer_concurrency == 16 and config.min_upload_compile_s == 0.5
    assert config.explain_misses is True and config.create_remote_root is True
    assert (config.lease_min_compile_rtts, config.wait_patience, config.compile_time_prior_s) == (6.0, None, 0.3)
    assert config.exit_timeout == 4.5
    assert (config.single_flight, config.wait_timeout, config.lease_ttl) == (False, 30.0, 20.0)
    assert (config.header_recheck_s, config.portable_keys) == (2.0, False)
    sources = config.sources()
    assert sources["remote"] == "env TIERED_PROGCACHE_REMOTE"
    assert sources["remote_read_only"] == "env TIERED_PROGCACHE_READ_ONLY"
    variables = {s.name: s.variable for s in settings.SETTINGS}
    assert all(sources[name] == f"env {variable}" for name, variable in variables.items() if variable in environ)
    assert set(environ) <= set(variables.values())  # each row's variable alone: test_text_reads_back_as_the_value
    assert [name for name, variable in variables.items() if not variable] == ["signing_key"]  # bytes: no variable


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
        assert cache.local_store.root == tmp_path / "local"
        cache[b"k"] = b"v"
        assert cache.flush(timeout=10)
    # The entry was signed with the file's bytes less the newline: that key reads it, the raw bytes do not.
    with RemoteProgramCache.from_url(url, signing_key=b"signing key") as same_key:
        assert same_key.read_key(b"k") == b"v"
    with RemoteProgramCache.from_url(url, signing_key=b"signing key\n") as raw_bytes, pytest.raises(EntryRejected):
        raw_bytes.read_key(b"k")


def test_build_from_env_reads_os_environ(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV + "DIR", str(tmp_path / "from-os-environ"))
    with TieredProgramCache.from_env() as cache:
        assert cache.local_store.root == tmp_path / "from-os-environ"
        assert cache.shared_store is None


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
    binary = tmp_path / "binary.key"
    binary.write_bytes(b" \x00key\t")
    binary.chmod(0o600)
    text = tmp_path / "text.key"
    text.write_bytes(b"deadbeef\n")
    text.chmod(0o600)
    env = {"TIERED_PROGCACHE_DIR": str(tmp_path / "d")}
    assert CacheConfig.from_env({**env, "TIERED_PROGCACHE_SIGNING_KEY_FILE": str(binary)}).read_signing_key() == b" \x00key\t"
    assert CacheConfig.from_env({**env, "TIERED_PROGCACHE_SIGNING_KEY_FILE": str(text)}).read_signing_key() == b"deadbeef"


# -- one validation for every way in ------------------------------------------------------------


@pytest.mark.parametrize("name", ["remote_read_only", "strict"])
def test_boolean_words_are_text_only(name):
    """``"false"`` is a true string in Python: as an argument it is refused, not read as a word."""
    assert getattr(CacheConfig.from_env({settings.by_name()[name].variable: "false"}), name) is False
    with pytest.raises(TypeError, match=f"^{name}: "):
        CacheConfig.from_env({}, **{name: "false"})
    with pytest.raises(TypeError, match=f"^{name}: "):
        TieredProgramCache(**{name: "false"})


def test_key_and_key_file_together_are_a_value_error(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(b"k")
    with pytest.raises(ValueError, match="signing_key and TIERED_PROGCACHE_SIGNING_KEY_FILE"):
        CacheConfig.from_env({ENV + "SIGNING_KEY_FILE": str(key_file)}, signing_key=b"k")


def test_a_signing_key_argument_is_used_as_given():
    assert CacheConfig(signing_key=b"raw\n").read_signing_key() == b"raw\n"


def test_repr_masks_secrets_and_storage_option_values():
    config = CacheConfig(signing_key=b"hunter2", remote_options={"key": "AKIA-secret", "anon": False})
    text = repr(config)
    assert "hunter2" not in text and "AKIA-secret" not in text
    assert "signing_key='***'" in text and "'key': '***'" in text and "'anon': '***'" in text
    assert config.signing_key == b"hunter2" and config.remote_options["key"] == "AKIA-secret"


def test_config_is_immutable_and_compares_by_value():
    config = CacheConfig(max_local_bytes=10)
    with pytest.raises(AttributeError):
        config.max_local_bytes = 5
    with pytest.raises(AttributeError):
        config.no_such_setting
    assert config == CacheConfig.from_env({ENV + "MAX_LOCAL_BYTES": "10"})
    assert config.as_dict() == {s.name: (10 if s.name == "max_local_bytes" else s.default) for s in settings.SETTINGS}


def test_the_documented_table_is_the_one_the_rows_write():
    """docs/configuration.md's table is written from SETTINGS (python -m tiered_progcache.settingsdoc): never stale."""
    from tiered_progcache import settingsdoc

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert doc.count(settingsdoc.BEGIN) == 1 and doc.count(settingsdoc.END) == 1
    written = doc.split(settingsdoc.BEGIN)[1].split(settingsdoc.END)[0].strip()
    assert written == settingsdoc.markdown_table(), "stale: run python -m tiered_progcache.settingsdoc"


def test_a_stale_table_is_found_and_rewritten(tmp_path):
    from tiered_progcache import settingsdoc

    page = tmp_path / "configuration.md"
    page.write_text(f"# Configuration\n\n{settingsdoc.BEGIN}\n| old | row |\n{settingsdoc.END}\n\nthe rest\n")
    assert settingsdoc.main(["--check", str(page)]) == 1 and "old" in page.read_text()  # --check writes nothing
    assert settingsdoc.main([str(page)]) == 0
    text = page.read_text()
    assert "| old | row |" not in text and settingsdoc.markdown_table() in text and text.endswith("the rest\n")
    assert settingsdoc.rewrite(page, check=True) is True


def test_every_setting_is_a_row_of_the_documented_table():
    """Each row of SETTINGS appears in docs/configuration.md with its variable and flag."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    rows = {}
    for line in doc.splitlines():
        match = re.match(r"\| `(\w+)` \|", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in line.strip().strip("|").split("|")]
    for setting in settings.SETTINGS:
        assert setting.name in rows, f"docs/configuration.md has no row for {setting.name}"
        _, variable, _, flag = rows[setting.name][:4]
        assert variable == (f"`{setting.variable}`" if setting.variable else "-"), setting.name
        assert flag.startswith(f"`{setting.flag}") if setting.flag else flag == "-", setting.name
    assert set(rows) == {s.name for s in settings.SETTINGS}  # and no row for a setting that is gone


# -- the command's options ------------------------------------------------------------------------

#: The configuration flags the command had before they came from the table.
OLD_FLAGS = {
    "--dir", "--remote", "--remote-options", "--read-only", "--signing-key-file",
    "--compression", "--remote-timeout", "--strict", "--max-local-bytes", "--transfer-concurrency",
    "--min-upload-compile-s", "--lease-min-compile-rtts", "--wait-patience", "--compile-time-prior-s",
    "--create-remote-root",
    "--exit-timeout",
}  # fmt: skip


def _parser(**kwargs):
    parser = argparse.ArgumentParser(exit_on_error=False)
    settings.add_arguments(parser, **kwargs)
    return parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}


def _table_flags() -> set[str]:
    """Every row's flag, and ``--no-x`` for a switch that is on by default."""
    flags = set()
    for setting in settings.SETTINGS:
        if setting.flag:
            flags.add(setting.flag)
            if setting.kind.switch and setting.default:
                flags.add("--no-" + setting.flag.removeprefix("--"))
    return flags


def test_add_arguments_gives_the_old_flags_and_every_row_s():
    assert OLD_FLAGS <= _flags(_parser()) == _table_flags()
    assert _flags(_parser(exclude={"remote"})) == _table_flags() - {"--remote"}


def test_a_switch_that_is_on_by_default_can_be_turned_off_and_on():
    assert settings.overrides_from_args(_parser().parse_args(["--no-single-flight"])) == {"single_flight": False}
    assert settings.overrides_from_args(_parser().parse_args(["--portable-keys"])) == {"portable_keys": True}
    assert settings.overrides_from_args(_parser().parse_args([])) == {}


def test_flags_parse_into_settings(tmp_path):
    argv = [
        "--dir", str(tmp_path / "d"), "--max-local-bytes", "20G", "--remote", "s3://bucket/k",
        "--remote-options", '{"anon": true}', "--read-only", "--signing-key-file", str(tmp_path / "key"),
        "--compression", "zstd", "--remote-timeout", "2.5", "--strict",
    ]  # fmt: skip
    overrides = settings.overrides_from_args(_parser().parse_args(argv))
    assert overrides == {
        "local_dir": tmp_path / "d",
        "max_local_bytes": 20 * 10**9,
        "remote": "s3://bucket/k",
        "remote_options": {"anon": True},
        "remote_read_only": True,
        "signing_key_file": tmp_path / "key",
        "compression": "zstd",
        "remote_timeout": 2.5,
        "strict": True,
    }
    config = CacheConfig.from_env({ENV + "MAX_LOCAL_BYTES": "1G", ENV + "STRICT": "0"}, **overrides)
    assert config.max_local_bytes == 20 * 10**9 and config.strict is True
    assert settings.overrides_from_args(_parser().parse_args([])) == {}  # unset flags leave the environment be
    assert settings.overrides_from_args(_parser(exclude={"remote"}).parse_args(["--dir", "x"]), exclude={"remote"}) == {
        "local_dir": Path("x")
    }


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--max-local-bytes", "lots"], "not a size"),
        (["--remote-timeout", "soon"], "not a number of seconds"),
        (["--remote-options", "[1, 2]"], "JSON object"),
        (["--remote-options", "{nope"], "not valid JSON"),
        (["--compression", "gzip"], "zstd or none"),
        (["--wait-patience", "soon"], "not a number"),
        (["--lease-min-compile-rtts", "-1"], "non-negative"),
        (["--lease-min-compile-rtts", "none"], "not a number"),
    ],
)
def test_bad_flag_values_are_usage_errors_naming_the_flag(argv, needle):
    with pytest.raises(argparse.ArgumentError, match=needle) as caught:
        _parser().parse_args(argv)
    assert argv[0] in str(caught.value)


def test_help_names_each_variable():
    text = _parser().format_help()
    for setting in settings.SETTINGS:
        if setting.flag:
            assert setting.flag in text and setting.variable in text


@pytest.mark.parametrize("setting", [s for s in settings.SETTINGS if s.variable], ids=lambda s: s.name)
def test_text_reads_back_as_the_value(setting, tmp_path):
    """What ``stats --run`` hands a child process in its environment means what the flag meant."""
    samples = {
        "local_dir": tmp_path, "max_memory_bytes": None, "max_local_bytes": 5 << 30, "remote": "memory://x/y",
        "remote_options": {"anon": True}, "remote_read_only": True, "signing_key_file": tmp_path / "k",
        "compression": None, "remote_timeout": 2.5, "strict": False, "create_remote_root": True, "max_pending_uploads": 7,
        "max_pending_upload_bytes": 1 << 20,
        "redis_expire_s": 3600.0,
        "transfer_concurrency": 16, "min_upload_compile_s": 0.25, "explain_misses": True,
        "lease_min_compile_rtts": 2.5, "wait_patience": None, "compile_time_prior_s": 0.75,
        "exit_timeout": 4.5, "single_flight": False, "wait_timeout": 0.0, "lease_ttl": 7.5,
        "header_recheck_s": 1.5, "portable_keys": False,
    }  # fmt: skip
    value = samples.get(setting.name, setting.default)  # a row added without a sample: its default round-trips
    text = setting.text(value)
    config = CacheConfig.from_env({setting.variable: text})
    assert config.as_dict()[setting.name] == value
    assert config.sources()[setting.name] == (f"env {setting.variable}" if text else "default")  # "" is unset


# -- a new setting is one row -------------------------------------------------------------------------


def test_a_setting_added_to_the_table_reaches_every_way_in(monkeypatch, tmp_path):
    """Adding a row (and nothing else) gives a variable, a constructor argument, a flag, the chain's value
    where the code that uses it reads it, and its row of the documented table, all checked."""
    from tiered_progcache import settingsdoc

    row = settings.Setting(
        "probe_interval_s", settings.SECONDS, 30.0, "seconds between two probes of a remote",
        env="PROBE_INTERVAL_S", flag="--probe-interval-s",
    )  # fmt: skip
    monkeypatch.setattr(settings, "SETTINGS", (*settings.SETTINGS, row))

    config = CacheConfig.from_env({ENV + "PROBE_INTERVAL_S": "45"})
    assert config.probe_interval_s == 45.0
    assert config.sources()["probe_interval_s"] == "env TIERED_PROGCACHE_PROBE_INTERVAL_S"
    assert CacheConfig.from_env({}).probe_interval_s == 30.0
    with pytest.raises(ValueError, match="^TIERED_PROGCACHE_PROBE_INTERVAL_S: "):
        CacheConfig.from_env({ENV + "PROBE_INTERVAL_S": "soon"})

    with TieredProgramCache(tmp_path, probe_interval_s=10.0) as cache:  # accepted: a chain-wide setting
        assert [t.name for t in cache.tiers] == ["memory", "local"]
        assert cache.settings.probe_interval_s == 10.0  # where the code that uses it reads it
    with TieredProgramCache(tiers=[InMemoryProgramCache()], probe_interval_s=11.0) as cache:
        assert cache.settings.probe_interval_s == 11.0
    with TieredProgramCache.from_env({ENV + "DIR": str(tmp_path), ENV + "PROBE_INTERVAL_S": "12"}) as cache:
        assert cache.settings.probe_interval_s == 12.0
        assert cache.settings.sources()["probe_interval_s"] == "env TIERED_PROGCACHE_PROBE_INTERVAL_S"
    with pytest.raises(ValueError, match="^probe_interval_s: "):
        TieredProgramCache(tmp_path, probe_interval_s=-1)

    overrides = settings.overrides_from_args(_parser().parse_args(["--probe-interval-s", "12"]))
    assert overrides == {"probe_interval_s": 12.0}
    assert "TIERED_PROGCACHE_PROBE_INTERVAL_S" in _parser().format_help()
    assert ("| `probe_interval_s` | `TIERED_PROGCACHE_PROBE_INTERVAL_S` | `probe_interval_s` | "
            "`--probe-interval-s SECONDS` | 30 s | seconds between two probes of a remote; chain-wide") in (
        settingsdoc.markdown_table())  # fmt: skip

    tier_shaping = dataclasses.replace(row, name="lease_dir", env=None, flag=None, builds_tiers=True)
    monkeypatch.setattr(settings, "SETTINGS", (*settings.SETTINGS, tier_shaping))
    with pytest.raises(ValueError, match="lease_dir"):  # a tier-building row is refused with tiers=
        TieredProgramCache(tiers=[InMemoryProgramCache()], lease_dir=1.0)


def test_no_setting_is_named_like_an_attribute_of_its_holder():
    """Settings are plain attributes of ConfigValues (fast to read): one named ``sources`` would hide the method."""
    from tiered_progcache.configvalues import ConfigValues

    assert not {s.name for s in settings.SETTINGS} & set(dir(ConfigValues))


def test_transfer_concurrency_reaches_the_remote(tmp_path):
    from tiered_progcache import TieredProgramCache

    with TieredProgramCache(tmp_path, remote="memory://tc/k", transfer_concurrency=3) as cache:
        assert cache.shared_store.transfer_concurrency == 3
    environ = {ENV + "REMOTE": "memory://tc/k", ENV + "TRANSFER_CONCURRENCY": "5", ENV + "DIR": str(tmp_path)}
    with CacheConfig.from_env(environ).build() as cache:
        assert cache.shared_store.transfer_concurrency == 5


# -- signing-key files: one reader ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "key"),
    [
        (b"hex-key-0123\n", b"hex-key-0123"),
        (b"hex-key-0123\r\n", b"hex-key-0123"),
        (b"hex-key-0123", b"hex-key-0123"),
        (b" \tbinary\x00key \n\n", b" \tbinary\x00key \n"),  # one line ending only; whitespace is key bytes
    ],
)
def test_every_way_to_give_a_key_file_reads_the_same_key(tmp_path, content, key):
    from tiered_progcache.config import read_key_file

    path = tmp_path / "key"
    path.write_bytes(content)
    path.chmod(0o600)
    assert read_key_file(path) == key
    assert CacheConfig(signing_key_file=path).read_signing_key() == key
    assert CacheConfig.from_env({ENV + "SIGNING_KEY_FILE": str(path)}).read_signing_key() == key


def test_an_entry_signed_through_the_variable_verifies_under_the_readme_reader(tmp_path):
    """Before: the README read the key with open().read(), keeping the newline the variable drops: every entry 'bad signature'."""
    from tiered_progcache.config import read_key_file
    from tiered_progcache.stores.localdir import entry_name

    path = tmp_path / "ci.key"
    path.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    path.chmod(0o600)
    remote = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()  # a missing file:// root is an error, not created
    with CacheConfig.from_env({ENV + "SIGNING_KEY_FILE": str(path), ENV + "REMOTE": remote, ENV + "DIR": str(tmp_path / "ci")}).build() as ci:
        ci[b"k"] = b"signed"
        assert ci.flush(30) is True
    with TieredProgramCache(tmp_path / "node", remote=remote, signing_key=read_key_file(path)) as node:
        assert node.shared_store.read_entry(entry_name(b"k")) == b"signed"


def test_the_readme_reads_key_files_with_the_one_reader():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "signing_key_file=" in readme
    assert not re.search(r"signing_key=open\(", readme)


def test_an_empty_key_file_is_an_error_naming_the_variable(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(b"\n")
    with pytest.raises(ValueError, match="^TIERED_PROGCACHE_SIGNING_KEY_FILE: the signing key file .* is empty"):
        CacheConfig.from_env({ENV + "SIGNING_KEY_FILE": str(path)}).read_signing_key()


def test_a_process_shared_chain_is_built_once_and_a_bad_setting_leaves_the_integration_alone(
    tmp_path, monkeypatch, caplog, cleanup
):
    """What Triton's manager and CuPy's backend share: one chain per process on their namespace, built on first need."""
    from tiered_progcache import TierStats
    from tiered_progcache.config import ProcessSharedChain

    log = logging.getLogger("tiered_progcache.example")
    monkeypatch.setenv(settings.ENV_PREFIX + "REMOTE_TIMEOUT", "-3")
    bad = ProcessSharedChain("cupy", log=log, label="Example cache", alone="its directory")
    assert (bad.if_built(), bad.built) == (None, False)  # reading builds nothing
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.example"):
        assert bad.get() is None and bad.get() is None  # built once: one warning
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("tiered_progcache.example", "Example cache: shared tiers not built, running on its directory alone: "
         "TIERED_PROGCACHE_REMOTE_TIMEOUT: must be a positive, finite number of seconds, got -3.0")]  # fmt: skip
    assert bad.built and dict(bad.stats("example-local", TierStats(hits=2))) == {"example-local": TierStats(hits=2)}

    monkeypatch.setenv(settings.ENV_PREFIX + "REMOTE_TIMEOUT", "2")
    (tmp_path / "remote").mkdir()
    monkeypatch.setenv(settings.ENV_PREFIX + "REMOTE", f"file://{tmp_path / 'remote'}")
    good = ProcessSharedChain("cupy", log=log, label="Example cache", alone="its directory")
    chain = cleanup.close(good.get(), 30)
    assert chain is good.get() is good.if_built() and chain.shared_store.namespace == "cupy"
    assert list(good.stats("example-local", TierStats())) == ["example-local", "remote"]
    with pytest.raises(TypeError):
        good.use(object())
    assert good.if_built() is chain
    mine = TieredProgramCache(tiers=[InMemoryProgramCache()])
    good.use(mine)
    assert good.get() is mine
    good.forget()
    assert (good.built, good.if_built()) == (False, None)
    rebuilt = cleanup.close(good.get(), 30)
    assert rebuilt is not None and rebuilt is not chain


def test_a_setting_kept_only_so_old_configurations_parse_is_warned_about_once_and_shown_unused(monkeypatch, caplog,
                                                                                               capsys):
    """`wait_patience` and `compile_time_prior_s` do nothing: a value other than the default gets one WARNING per
    process naming where it came from and why, and `config` marks both rows; a default or a setting in use, none."""
    from tiered_progcache import configvalues
    from tiered_progcache.configvalues import ConfigValues

    from support import run_cli_here

    assert [s.name for s in settings.SETTINGS if s.unused] == ["wait_patience", "compile_time_prior_s"]
    monkeypatch.setattr(configvalues, "_warned_unused", set())
    with caplog.at_level(logging.WARNING, logger="tiered_progcache.configvalues"):
        ConfigValues.from_env({"TIERED_PROGCACHE_WAIT_PATIENCE": "2"})
        ConfigValues.from_env({"TIERED_PROGCACHE_WAIT_PATIENCE": "3"})  # once per process
        ConfigValues(compile_time_prior_s=settings.by_name()["compile_time_prior_s"].default)  # the default: nothing
        ConfigValues(lease_min_compile_rtts=2.0)  # in use: nothing
        ConfigValues(compile_time_prior_s=0.5)
    assert [r.getMessage() for r in caplog.records if r.name == "tiered_progcache.configvalues"] == [
        "TIERED_PROGCACHE_WAIT_PATIENCE does nothing (kept so old configurations parse): a waiter waits while the "
        "holder's lease is renewed, up to wait_timeout; remove it",
        "compile_time_prior_s does nothing (kept so old configurations parse): a compile never timed on this node "
        "takes the lease, whatever a prior would say; remove it",
    ]
    rows = run_cli_here(capsys, "config", env={"TIERED_PROGCACHE_WAIT_PATIENCE": "2"}).stdout.splitlines()
    marked = sorted(row.split()[0] for row in rows if row.endswith("(unused)"))
    assert marked == ["compile_time_prior_s", "wait_patience"]
    assert any(row.startswith("wait_patience") and row.endswith("env TIERED_PROGCACHE_WAIT_PATIENCE (unused)")
               for row in rows)
