"""The settings rows for several shared tiers (``remote`` as a list) and the Redis expiry."""

from __future__ import annotations

import pytest

from tiered_progcache import settings
from tiered_progcache.config import CacheConfig

ENV = settings.ENV_PREFIX
TWO = ("redis://cache:6379/0", "s3://ci-kernels/cuda13")


def test_remote_takes_a_list_in_order():
    assert CacheConfig(remote=list(TWO)).remote == TWO
    assert CacheConfig(remote=TWO).remote == TWO
    assert CacheConfig(remote=["s3://only/one"]).remote == "s3://only/one"  # one URL stays a str
    assert CacheConfig(remote="redis://cache:6379/0").remote == "redis://cache:6379/0"
    assert settings.remote_urls(TWO) == TWO and settings.remote_urls("s3://a/b") == ("s3://a/b",)
    assert settings.remote_urls(None) == ()


@pytest.mark.parametrize("text", [",".join(TWO), " , ".join(TWO), '["redis://cache:6379/0", "s3://ci-kernels/cuda13"]'])
def test_remote_variable_is_comma_separated_or_a_json_list(text):
    config = CacheConfig.from_env({ENV + "REMOTE": text})
    assert config.remote == TWO
    row = settings.by_name()["remote"]
    assert row.parse_text(row.text(config.remote)) == TWO  # a child process reads back what the parent had


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ([], ValueError, "at least one URL"),
        (["s3://a/b", "s3://a/b"], ValueError, "one URL twice"),
        (["s3://a/b", 3], TypeError, "list of URLs"),
        (["redis://h:6379/notadb"], ValueError, "database number"),
        (["redis://h/0", "ftpx://nope"], ValueError, "unknown URL scheme"),
    ],
)
def test_bad_remote_lists_name_the_setting(value, error, match):
    with pytest.raises(error, match=f"^remote: .*{match}"):
        CacheConfig(remote=value)


@pytest.mark.parametrize("text", ["s3://a/b,,redis://h/0", '["s3://a/b"', '{"a": "s3://a/b"}'])
def test_bad_remote_text_names_the_variable(text):
    with pytest.raises(ValueError, match=f"^{ENV}REMOTE: "):
        CacheConfig.from_env({ENV + "REMOTE": text})


def test_redis_expire_setting():
    assert CacheConfig().redis_expire_s is None
    assert CacheConfig.from_env({ENV + "REDIS_EXPIRE_S": "604800"}).redis_expire_s == 604800.0
    with pytest.raises(ValueError, match="^redis_expire_s: "):
        CacheConfig(redis_expire_s=0)
    with pytest.raises(ValueError, match=f"^{ENV}REDIS_EXPIRE_S: "):
        CacheConfig.from_env({ENV + "REDIS_EXPIRE_S": "a week"})


def test_a_password_in_a_remote_url_never_shows_in_the_repr():
    config = CacheConfig(remote=["rediss://:hunter2pw@cache:6380/0", "s3://b/k"])
    assert "hunter2pw" not in repr(config)
    assert "rediss://:***@cache:6380/0" in repr(config) and "s3://b/k" in repr(config)
    assert "hunter2pw" not in repr(CacheConfig(remote="redis://user:hunter2pw@cache:6379/0"))
    assert config.remote[0] == "rediss://:hunter2pw@cache:6380/0"  # the value itself is intact
