"""Every bad input the issue found accepted silently: each is a TypeError or ValueError naming the problem."""

from __future__ import annotations

import json
import logging

import pytest

from tiered_progcache import CacheConfig, TieredProgramCache
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401  (fixtures)

from support import assert_one_line_error, run_cli

DEEP_JSON = "[" * 20_000 + "]" * 20_000  # json recurses per level: RecursionError past ~1000


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"remote_read_only": "false"}, TypeError, "^remote_read_only: must be True or False"),
        ({"strict": "false"}, TypeError, "^strict: must be True or False"),
        ({"path": ""}, ValueError, "^local_dir: .*empty"),
        ({"local_dir": ""}, ValueError, "^local_dir: .*empty"),
        ({"signing_key": 123}, TypeError, "^signing_key: must be bytes or str"),
        ({"compression": "lz4"}, ValueError, "^compression: must be zstd or none"),
        ({"remote_timeout": "soon"}, TypeError, "^remote_timeout: must be a number of seconds"),
        ({"remote_options": 42}, TypeError, "^remote_options: must be a mapping"),
        ({"remote_options": DEEP_JSON}, ValueError, "^remote_options: .*nested"),
        ({"max_pending_upload_bytes": 0}, ValueError, "^max_pending_upload_bytes: must be positive"),
        ({"max_pending_upload_bytes": 1.5}, TypeError, "^max_pending_upload_bytes: must be an int"),
    ],
    ids=lambda value: str(value)[:40] if not isinstance(value, type) else value.__name__,
)
def test_bad_keyword_settings_are_errors_naming_them(tmp_path, settings, error, match):
    if "path" not in settings and "local_dir" not in settings:
        settings = {"path": tmp_path, **settings}
    with pytest.raises(error, match=match):
        TieredProgramCache(**settings)


@pytest.mark.parametrize(
    ("variable", "text", "match"),
    [
        ("REMOTE_OPTIONS", DEEP_JSON, "^TIERED_PROGCACHE_REMOTE_OPTIONS: .*nested"),
        ("READ_ONLY", "maybe", "^TIERED_PROGCACHE_READ_ONLY: not a boolean"),
        ("MAX_PENDING_UPLOAD_BYTES", "lots", "^TIERED_PROGCACHE_MAX_PENDING_UPLOAD_BYTES: "),
        ("REMOTE_TIMEOUT", "soon", "^TIERED_PROGCACHE_REMOTE_TIMEOUT: not a number of seconds"),
    ],
)
def test_bad_variables_are_value_errors_naming_them(variable, text, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig.from_env({"TIERED_PROGCACHE_" + variable: text})


def test_a_misspelt_storage_option_is_a_type_error_with_strict_and_an_error_line_without(tmp_path, s3_bucket, caplog):
    """Before: ``endpoint_ur1`` made the filesystem fail and the cache ran local-only, silently. Without ``strict``
    the probe runs beside the first compile: one ERROR line names the option, and the tier counts one error."""
    options = dict(s3_bucket.storage_options)
    options["endpoint_ur1"] = options.pop("endpoint_url")
    with pytest.raises(TypeError, match="endpoint_ur1"):
        TieredProgramCache(tmp_path, remote=s3_bucket.url, remote_options=options, strict=True, remote_timeout=2)
    with caplog.at_level(logging.ERROR, logger="tiered_progcache"):
        cache = TieredProgramCache(tmp_path, remote=s3_bucket.url, remote_options=options, remote_timeout=2)
        assert cache.shared_store.wait_ready(60)
    lines = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(lines) == 1 and "endpoint_ur1" in lines[0] and "correct the storage options" in lines[0], lines
    assert not cache.shared_store.available
    assert cache.stats()["remote"].errors == 1


def test_deeply_nested_remote_options_in_the_command_is_a_usage_error(tmp_path):
    result = run_cli("config", env={"TIERED_PROGCACHE_REMOTE_OPTIONS": DEEP_JSON})
    assert "TIERED_PROGCACHE_REMOTE_OPTIONS" in assert_one_line_error(result)
