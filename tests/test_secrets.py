"""Secrets never reach output, logs or reprs: planted in every setting and storage option, then searched for."""

from __future__ import annotations

import json
import logging

import pytest
from support import run_cli

from tiered_progcache import CacheConfig, TieredProgramCache
from tiered_progcache.stores.localdir import entry_name
from tiered_progcache.testing.servers import moto_server, s3_bucket  # noqa: F401  (fixtures)

SECRETS = {
    "signing": "PLANTED-SIGNING-KEY-0001",
    "url_password": "PLANTED-URL-PASSWORD-0002",
    "secret": "PLANTED-SECRET-0003",
    "nested_secret": "PLANTED-NESTED-SECRET-0004",
    "session_token": "PLANTED-SESSION-TOKEN-0005",
    "proxy_password": "PLANTED-PROXY-PASSWORD-0006",
    "nested_token": "PLANTED-DEEP-TOKEN-0007",
    "account_key": "PLANTED-ACCOUNT-KEY-0008",
    "connection_string": "PLANTED-CONNECTION-STRING-0009",
    "sse_customer_key": "PLANTED-SSE-CUSTOMER-KEY-0010",
}


def _planted_options(base: dict) -> dict:
    options = dict(base)
    options["secret"] = SECRETS["secret"]  # s3fs reads "secret": it must still work, so the moto value is kept below
    options["client_kwargs"] = {
        **base.get("client_kwargs", {}),
        "aws_secret_access_key": SECRETS["nested_secret"],
        "aws_session_token": SECRETS["session_token"],
    }
    options["config_kwargs"] = {"proxies": {"https": f"http://user:{SECRETS['proxy_password']}@proxy.invalid:3128"}}
    options["extra"] = {"levels": [{"auth": {"bearer_token": SECRETS["nested_token"]}}]}
    options["account_key"] = SECRETS["account_key"]
    options["connection_string"] = SECRETS["connection_string"]
    options["s3_additional_kwargs"] = {"SSECustomerKey": SECRETS["sse_customer_key"]}
    return options


def _leaks(text: str) -> list[str]:
    return [name for name, secret in SECRETS.items() if secret in text]


def test_config_repr_masks_every_secret_at_any_depth(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(SECRETS["signing"])
    config = CacheConfig(
        remote=f"s3://user:{SECRETS['url_password']}@bucket/kernels",
        remote_options=_planted_options({"endpoint_url": "http://127.0.0.1:1"}),
        signing_key=SECRETS["signing"],
    )
    shown = repr(config) + str(config) + json.dumps(config.masked(), default=str)
    assert _leaks(shown) == []
    assert "http://127.0.0.1:1" in shown  # what is not secret is still shown, to debug a config


def test_no_secret_in_reprs_logs_or_stats_of_a_working_cache(tmp_path, s3_bucket, caplog):
    """Secrets the S3 client really uses (nested in client_kwargs), and the signing key, through a whole session."""
    options = {
        "endpoint_url": s3_bucket.storage_options["endpoint_url"],
        "client_kwargs": {
            "region_name": "us-east-1",
            "aws_access_key_id": "testing",
            "aws_secret_access_key": SECRETS["nested_secret"],
            "aws_session_token": SECRETS["session_token"],
        },
    }
    planted = {k: SECRETS[k] for k in ("signing", "nested_secret", "session_token")}
    with caplog.at_level(logging.DEBUG):
        cache = TieredProgramCache(tmp_path, remote=s3_bucket.url, remote_options=options, signing_key=SECRETS["signing"])
        cache[b"k"] = b"v" * 10
        assert cache.flush(30) is True
        assert cache.shared_store.read_entry(entry_name(b"k")) == b"v" * 10  # the secrets really were used
        cache.get(b"missing")
        del cache[b"k"]
        texts = [repr(cache), str(cache.stats()), json.dumps(cache.stats().as_dict())]
        texts += [repr(t.resource) for t in cache.tiers] + [repr(cache.shared_store), cache.shared_store.location]
        cache.close()
    # Ours only: botocore.auth logs the canonical request (session token included) at DEBUG, which
    # no setting of ours controls; the command turns on DEBUG for tiered_progcache only.
    texts += [record.getMessage() for record in caplog.records if record.name.startswith("tiered_progcache")]
    assert [name for name, secret in planted.items() if any(secret in text for text in texts)] == []


@pytest.mark.parametrize("form", [[], ["--json"]], ids=["text", "json"])
def test_config_command_prints_no_secret(tmp_path, form):
    key_file = tmp_path / "key"
    key_file.write_text(SECRETS["signing"])
    key_file.chmod(0o600)
    env = {
        "TIERED_PROGCACHE_REMOTE": f"s3://user:{SECRETS['url_password']}@bucket/kernels",
        "TIERED_PROGCACHE_REMOTE_OPTIONS": json.dumps(_planted_options({"endpoint_url": "http://127.0.0.1:1"})),
        "TIERED_PROGCACHE_SIGNING_KEY_FILE": str(key_file),
    }
    result = run_cli("config", "-vv", *form, env=env)
    assert result.returncode == 0, result.stderr
    assert _leaks(result.stdout + result.stderr) == []
    assert "127.0.0.1:1" in result.stdout


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: connections to it are refused


def test_manifests_explanations_and_the_explain_command_hold_no_secret(tmp_path, s3_bucket, monkeypatch, caplog):
    """Secrets planted everywhere a compile could pick one up; then every stored byte and every output is searched."""
    pytest.importorskip("redis")
    import tiered_progcache
    from cuda.core import ProgramOptions

    from tiered_progcache.compiling.manifest import manifest_name

    env_secrets = {"AWS_SECRET_ACCESS_KEY": "PLANTED-ENV-AWS-SECRET-0011", "MY_API_TOKEN": "PLANTED-ENV-TOKEN-0012"}
    planted = {**{k: SECRETS[k] for k in ("signing", "url_password", "nested_secret", "session_token")}, **env_secrets}
    for variable, value in env_secrets.items():
        monkeypatch.setenv(variable, value)
    key_file = tmp_path / "key"
    key_file.write_text(SECRETS["signing"])
    key_file.chmod(0o600)
    options = {"endpoint_url": s3_bucket.storage_options["endpoint_url"], "client_kwargs": {
        "region_name": "us-east-1", "aws_access_key_id": "testing",
        "aws_secret_access_key": SECRETS["nested_secret"], "aws_session_token": SECRETS["session_token"]}}  # fmt: skip
    redis_with_password = f"redis://:{SECRETS['url_password']}@127.0.0.1:{_closed_port()}/0"  # down: warned, skipped
    env = {
        "TIERED_PROGCACHE_DIR": str(tmp_path / "node"),
        "TIERED_PROGCACHE_REMOTE": f"{s3_bucket.url},{redis_with_password}",
        "TIERED_PROGCACHE_REMOTE_OPTIONS": json.dumps(options),
        "TIERED_PROGCACHE_SIGNING_KEY_FILE": str(key_file),
        "TIERED_PROGCACHE_EXPLAIN": "1",
    }
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    src = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n'
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache"):
        with TieredProgramCache.from_env() as cache:
            tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_80"), cache=cache)
            tiered_progcache.compile(src, "c++", ProgramOptions(arch="sm_80", std="c++20"), cache=cache)
            assert cache.flush(30)
            texts.append(str(tiered_progcache.explain(src, "c++", ProgramOptions(arch="sm_90"), cache=cache)))
    texts += [record.getMessage() for record in caplog.records if record.name.startswith("tiered_progcache")]
    assert any("option `--std=c++20` only in this compile" in text for text in texts)  # the explain line was logged

    stored = [p.read_bytes() for p in (tmp_path / "node").rglob("*") if p.is_file()]
    objects = [o for o in s3_bucket.objects() if "/entries/" in o]
    stored += [s3_bucket.fs.cat(o) for o in objects]
    names = [o.rsplit("/", 2)[1] + o.rsplit("/", 2)[2] for o in objects]
    manifests = [n for n in names if n in {manifest_name(m) for m in names}]
    assert len(objects) == 4 and len(manifests) == 2  # two cubins and their manifests reached the bucket, signed
    assert all(blob[:4] != b"TPCE" or blob[5] & 0x02 for blob in stored)

    cli_env = {**env, "TIERED_PROGCACHE_REMOTE": s3_bucket.url}
    for args in (["ls", "--long"], ["ls", "--long", "--remote"], ["explain", manifests[0]],
                 ["explain", manifests[0], "--remote", "--json"], ["explain", names[0], "-vv"]):  # fmt: skip
        result = run_cli(*args, env=cli_env)
        assert result.returncode in (0, 1), result.stderr
        texts += [result.stdout, result.stderr]
    assert "c++->cubin" in texts[-10] and '"written_by"' in texts[-4]  # the manifests really were shown
    blobs = b"\n".join(stored)
    assert [name for name, secret in planted.items() if secret.encode() in blobs or any(secret in t for t in texts)] == []


# -- issue 19 item 10: every Redis URL form redis-py accepts, against a real redis-server ----------

#: Passwords of the Redis forms; the "@" one must be masked whole, not up to its first "@".
REDIS_PASSWORDS = {
    "query": "PLANTED-REDIS-QUERY-PW-0013",
    "unix": "PLANTED-REDIS-UNIX-PW-0014",
    "at_sign": "p@ssPLANTED-REDIS-AT-PW-0015",
}


def _redis_url(form: str, server) -> str:
    password = REDIS_PASSWORDS[form]
    if form == "query":  # redis-py's documented form: redis://host/0?password=PW
        return f"redis://127.0.0.1:{server.port}/0?password={password}"
    if form == "unix":  # unix:///path?db=0&password=PW
        return f"unix://{server.unix_socket}?db=0&password={password}"
    return f"redis://default:{password}@127.0.0.1:{server.port}/0"  # the LAST "@" ends the userinfo


def _redis_leaks(form: str, text: str) -> list[str]:
    password = REDIS_PASSWORDS[form]
    return [piece for piece in (password, password.split("@")[-1]) if piece in text]


@pytest.mark.parametrize("form", sorted(REDIS_PASSWORDS))
def test_no_redis_password_of_any_form_in_repr_location_config_stats_or_the_down_warning(form, tmp_path, caplog):
    """repr, location, `config`, `stats --remote` and the warning logged when the server is down, for each form."""
    pytest.importorskip("redis")
    from tiered_progcache.stores.redis_store import RedisProgramCache
    from tiered_progcache.testing.redis_server import RedisServer

    server = RedisServer(requirepass=REDIS_PASSWORDS[form], unix_socket=form == "unix").start()
    texts: list[str] = []
    try:
        url = _redis_url(form, server)
        tier = RedisProgramCache.from_url(url, strict=True)  # the password really is right: PING answered
        tier.write_key(b"k", b"v")
        assert tier.read_key(b"k") == b"v"
        texts += [repr(tier), tier.location, repr(tier.leases()), tier.leases().location, repr(CacheConfig(remote=url))]
        tier.close()
        env = {"TIERED_PROGCACHE_DIR": str(tmp_path / "node"), "TIERED_PROGCACHE_REMOTE": url}
        shown = {}
        for args in (["config"], ["config", "--json"], ["stats", "--remote"], ["stats", "--remote", "--json"],
                     ["stats"], ["ls", "--remote", "-vv"]):  # fmt: skip
            result = shown[" ".join(args)] = run_cli(*args, env=env)
            assert result.returncode == 0, (args, result.stderr)
            texts += [result.stdout, result.stderr]
        assert json.loads(shown["stats --remote --json"].stdout)["remote"]["entries"] == 1  # it really listed the server
    finally:
        server.kill()
        server.close()
    with caplog.at_level(logging.DEBUG, logger="tiered_progcache"):  # the server is down now
        with TieredProgramCache(tmp_path / "other", remote=url) as down:  # warns, then runs without it
            assert down.get(b"k") is None
            texts += [repr(down), repr(down.shared_store), down.shared_store.location, str(down.stats())]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("is unreachable" in w for w in warnings), warnings  # the down-server warning was logged
    texts += [record.getMessage() for record in caplog.records]
    for args in (["stats", "--remote", "-vv"], ["ls", "--remote", "-vv"]):
        result = run_cli(*args, env=env)
        assert result.returncode == 1 and "unreachable" in result.stderr, result.stderr
        texts += [result.stdout, result.stderr]
    assert [text for text in texts if _redis_leaks(form, text)] == []
    assert any("***" in text for text in texts)  # masked, not dropped: a reader sees a password is set


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://cache:6379/0?password=PW", "redis://cache:6379/0?password=***"),
    ("unix:///run/redis.sock?db=0&password=PW", "unix:///run/redis.sock?db=0&password=***"),
    ("unix://:PW@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
    ("redis://user:p@ssPW@cache:6379/0", "redis://user:***@cache:6379/0"),
    ("rediss://:a@b@c@cache:6380/0/prefix", "rediss://:***@cache:6380/0/prefix"),
    ("redis://cache/0?pass=PW&token=PW&api_key=PW&prefix=kernels", "redis://cache/0?pass=***&token=***&api_key=***&prefix=kernels"),
    ("redis://user@cache/0", "redis://user@cache/0"),  # a user name alone is not secret
    ("redis://user@cache:6379/0", "redis://user@cache:6379/0"),  # the port's colon is no password's
    ("redis://:PW@", "redis://:***@"),  # cut short after the userinfo: still masked
    ("redis://:PW@cache failed; mail ops@example", "redis://:***@cache failed; mail ops@example"),  # text after a URL
    ("simplecache::sftp://alice:PW@host/k", "simplecache::sftp://alice:***@host/k"),
    ("abfs://container@account.dfs.core.windows.net/k", "abfs://container@account.dfs.core.windows.net/k"),
    ("https://acct.blob.core.windows.net/c?sv=2024&sig=PW", "https://acct.blob.core.windows.net/c?sv=2024&sig=***"),
    ("redis://cache?password=a@PW", "redis://cache?password=***"),
    ("redis://u:a::PW@cache", "redis://u:***@cache"),
    ("s3://bucket/k,redis://:PW@cache/0", "s3://bucket/k,redis://:***@cache/0"),
    ("connecting to redis://:PW@cache:1/0 failed", "connecting to redis://:***@cache:1/0 failed"),
])  # fmt: skip
def test_one_masking_function_understands_every_url_form(url, shown):
    from tiered_progcache.config import masked
    from tiered_progcache.redact import mask_url
    from tiered_progcache.stores.sharedstore import without_password

    assert mask_url(url) == masked(url) == without_password(url) == shown
    assert masked({"remote": [url], "storage_options": {"password": "PW", "nested": {"sas_token": "PW"}}}) == {
        "remote": [shown], "storage_options": {"password": "***", "nested": {"sas_token": "***"}}}  # fmt: skip
