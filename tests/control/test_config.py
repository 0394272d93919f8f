"""The controller's config file: every duration parses one way, and a wrong key or type is an
error at start that names the key and the file (seen: `probe_timeout: 10s` reached arithmetic
as a string, and unknown keys inside sections were taken silently)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from llmgw.control.config import load_config
from llmgw.errors import ConfigError
from llmgw.reconciler.config import ReconcilerConfig
from llmgw.router.config import RouterConfig

DIGEST = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def write(tmp_path: Path, text: str, repo: str = "repo: /srv/catalog\n") -> Path:
    path = tmp_path / "controller.yaml"
    path.write_text(repo + text)
    return path


def test_a_repo_that_is_not_a_string_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="repo: \\['a', 'b'\\] must be a string"):
        load_config(write(tmp_path, "", repo="repo: [a, b]\n"))


def test_every_float_knob_takes_a_duration(tmp_path: Path) -> None:
    rec = [f.name for f in dataclasses.fields(ReconcilerConfig) if f.type in ("float", float)]
    rou = [f.name for f in dataclasses.fields(RouterConfig) if f.type in ("float", float)]
    assert {"probe_timeout", "backoff_base", "crash_reset_after"} <= set(rec)
    text = "fetch_interval: 1m\nreconciler:\n" + "".join(f"  {k}: 1m30s\n" for k in rec)
    text += "router:\n" + "".join(f"  {k}: 250ms\n" for k in rou)
    cfg = load_config(write(tmp_path, text))
    assert cfg.controller.fetch_interval == 60.0
    assert all(getattr(cfg.controller.reconciler, k) == 90.0 for k in rec)
    assert cfg.router == {k: 0.25 for k in rou}
    assert RouterConfig(**cfg.router).first_byte_timeout == 0.25  # what the server builds from it
    plain = load_config(write(tmp_path, "reconciler:\n  probe_timeout: 7\n  concurrency: 4\n"))
    assert plain.controller.reconciler.probe_timeout == 7.0 and plain.controller.reconciler.concurrency == 4


@pytest.mark.parametrize(("text", "words"), [
    ("probe_timeout: 10s\n", "unknown key(s): probe_timeout"),  # at the top level instead of reconciler
    ("reconciler:\n  probe_timout: 10s\n", "reconciler: unknown key(s): probe_timout (known: backoff_base"),
    ("router:\n  retry: 2\n", "router: unknown key(s): retry"),
    ("listen:\n  api: 127.0.0.1:1\n", "listen: unknown key(s): api"),
    ("ssh:\n  identity: k\n", "ssh: unknown key(s): identity"),
    ("reconciler:\n  backoff_base: soon\n", "reconciler.backoff_base: \"soon\" is not a duration"),
    ("reconciler:\n  backoff_base: -1\n", "reconciler.backoff_base: -1 is negative"),
    ("reconciler:\n  crash_loop_after: 5s\n", "reconciler.crash_loop_after: '5s' must be a whole number"),
    ("reconciler:\n  concurrency: true\n", "reconciler.concurrency: True must be a whole number"),
    ("router:\n  retries: 1.5\n", "router.retries: 1.5 must be a whole number"),
    ("watch: 'false'\n", "watch: 'false' must be true or false"),
    ("reconciler: [1, 2]\n", "reconciler: expected a mapping, got list"),
    ("api_keys:\n  - {name: a, sha256: " + DIGEST + ", model: [chat]}\n", "api_keys[0]: unknown key(s): model"),
    ("api_keys:\n  - {name: a, sha256: abc}\n", "api_keys[0]: sha256 must be 64 hex digits"),
    ("fetch_interval: .nan\n", "fetch_interval: nan is not a finite duration"),
    ("reconciler:\n  unreachable_grace: .inf\n", "reconciler.unreachable_grace: inf is not a finite duration"),
    ("reconciler:\n  tick_interval: 0\n", "reconciler.tick_interval: must be more than 0"),
    ("reconciler:\n  concurrency: 0\n", "reconciler.concurrency: must be at least 1"),
    ("branch: 1.10\n", "branch: 1.1 must be a string (quote it)"),
    ("data_dir: 5\n", "data_dir: 5 must be a string"),
    ("admin_token: [secret]\n", "admin_token: ['secret'] must be a string"),
    ("ssh:\n  key: 5\n", "ssh.key: 5 must be a string"),
    ("reconciler:\n  stop_grace: 15m\n", "reconciler.stop_grace: at most 600 s"),
    ("router:\n  keepalive_timeout: 0\n", "router.keepalive_timeout: must be more than 0"),
    ("router:\n  limits_routers: -2\n", "router.limits_routers: -2 is negative"),
])
def test_a_wrong_key_or_type_names_the_key_and_the_file(tmp_path: Path, text: str, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ") and words in str(err.value), str(err.value)


def test_no_pooling_is_a_setting_not_an_error(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "router:\n  max_idle: 0\n")).router == {"max_idle": 0}


def test_secrets_come_from_the_environment_then_the_file_then_the_yaml(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "admin.token").write_text("from-file\n")
    (tmp_path / "hook.secret").write_text("hook-from-file")
    path = write(tmp_path, "admin_token_file: admin.token\nwebhook_secret_file: hook.secret\n")
    monkeypatch.delenv("LLMGW_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("LLMGW_WEBHOOK_SECRET", raising=False)
    cfg = load_config(path)
    assert (cfg.admin_token, cfg.webhook_secret) == ("from-file", "hook-from-file")
    assert "from-file" not in repr(cfg)
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "from-env")
    assert load_config(path).admin_token == "from-env"
    monkeypatch.delenv("LLMGW_ADMIN_TOKEN")
    missing = write(tmp_path, "admin_token_file: nowhere.token\n")
    with pytest.raises(ConfigError, match="admin_token_file: cannot read"):
        load_config(missing)


def test_the_leader_lease_timing_is_a_setting_checked_whole(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "leadership:\n  ttl: 10s\n  renew: 2s\n  retry: 500ms\n  margin: 2s\n"))
    lead = cfg.controller.leadership
    assert (lead.ttl, lead.renew, lead.retry, lead.margin) == (10.0, 2.0, 0.5, 2.0)
    assert load_config(write(tmp_path, "")).controller.leadership.ttl == 4.0
    # A renewal later than the lease can last would let two controllers lead.
    with pytest.raises(ConfigError, match=r"controller\.yaml: leadership: .*renew < ttl - margin"):
        load_config(write(tmp_path, "leadership:\n  ttl: 2s\n  renew: 3s\n"))
    with pytest.raises(ConfigError, match=r"leadership: unknown key\(s\): tll"):
        load_config(write(tmp_path, "leadership:\n  tll: 2s\n"))


def test_commit_statuses_are_configured_whole_and_their_token_kept_out_of_sight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_COMMIT_STATUS_TOKEN", raising=False)
    (tmp_path / "status-token").write_text("ghp-secret\n")
    cfg = load_config(write(tmp_path, "commit_status:\n  provider: github\n  repo: acme/fleet\n"
                                      "  token_file: status-token\n"))
    status = cfg.controller.commit_status
    assert status is not None and (status.url, status.repo, status.token) == (
        "https://api.github.com", "acme/fleet", "ghp-secret")
    assert "ghp-secret" not in repr(cfg.controller)
    assert status.endpoint("a" * 40) == "https://api.github.com/repos/acme/fleet/statuses/" + "a" * 40
    monkeypatch.setenv("LLMGW_COMMIT_STATUS_TOKEN", "from-env")
    gitea = load_config(write(tmp_path, "commit_status: {provider: gitea, url: 'https://git.internal', "
                                        "repo: ops/catalog}\n")).controller.commit_status
    assert gitea is not None and gitea.token == "from-env"
    assert gitea.endpoint("b" * 40) == "https://git.internal/api/v1/repos/ops/catalog/statuses/" + "b" * 40
    for text, words in (("commit_status: {provider: gitlab, repo: a/b}\n", "must be github or gitea"),
                        ("commit_status: {provider: gitea, repo: a/b}\n", "commit_status.url"),
                        ("commit_status: {provider: github, url: 'https://u:p@api.github.com', repo: a/b}\n",
                         "without a credential"),
                        ("commit_status: {provider: github, repo: 'a b'}\n", "must be owner/name"),
                        ("commit_status: {provider: github, repo: a/b, tokn: x}\n", "unknown key(s): tokn")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_config(write(tmp_path, text))
    behind_tls = load_config(write(tmp_path, "listen: {admin: '0.0.0.0:8081'}\noidc:\n  issuer: https://l.example\n"
                                             "  client_id: x\n  roles: {a: admin}\n"
                                             "  redirect_url: https://llmgw.example/auth/callback\n"))
    assert behind_tls.oidc is not None and behind_tls.oidc.redirect_url == "https://llmgw.example/auth/callback"
    monkeypatch.delenv("LLMGW_COMMIT_STATUS_TOKEN")
    with pytest.raises(ConfigError, match="no token"):
        load_config(write(tmp_path, "commit_status: {provider: github, repo: a/b}\n"))


def test_the_identity_provider_is_configured_whole_and_its_secret_kept_out_of_sight(tmp_path: Path) -> None:
    from llmgw.access.roles import Role

    (tmp_path / "oidc.secret").write_text("s3cr3t-client\n")
    cfg = load_config(write(tmp_path, "oidc:\n  issuer: https://login.example.com/realms/gpu\n  client_id: llmgw\n"
                                      "  client_secret_file: oidc.secret\n"
                                      "  roles: {gpu-ops: operator, fleet-admins: admin}\n"))
    assert cfg.oidc is not None and cfg.oidc.client_secret == "s3cr3t-client"
    assert dict(cfg.oidc.roles) == {"gpu-ops": Role.OPERATOR, "fleet-admins": Role.ADMIN}
    assert cfg.oidc.expected_audience == "llmgw" and "s3cr3t" not in repr(cfg) + repr(cfg.oidc)
    for text, words in (
        ("oidc:\n  issuer: http://login.example.com\n  client_id: x\n  roles: {a: admin}\n", "is not https"),
        ("oidc:\n  issuer: https://login.example.com\n  roles: {a: admin}\n", "issuer and client_id are required"),
        ("oidc:\n  issuer: https://l.example\n  client_id: x\n  roles: {a: root}\n", "oidc.roles.a: unknown role"),
        ("oidc:\n  issuer: https://l.example\n  client_id: x\n", "map at least one"),
        ("oidc:\n  issuer: https://l.example\n  client_id: x\n  roles: {a: admin}\n  scope: x\n", "scope"),
        # Off this machine the callback is configured, never built from a request's Host header.
        ("listen: {admin: '0.0.0.0:8081'}\noidc:\n  issuer: https://l.example\n  client_id: x\n  roles: {a: admin}\n",
         "oidc.redirect_url is required when the admin API listens on 0.0.0.0"),
        ("oidc:\n  issuer: https://l.example\n  client_id: x\n  roles: {a: admin}\n"
         "  redirect_url: http://llmgw.example/auth/callback\n", "oidc.redirect_url http://llmgw.example"),
        ("oidc:\n  issuer: https://l.example\n  client_id: x\n  roles: {a: admin}\n"
         "  redirect_url: https://llmgw.example/elsewhere\n", "must end in /auth/callback"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_config(write(tmp_path, text))
    behind_tls = load_config(write(tmp_path, "listen: {admin: '0.0.0.0:8081'}\noidc:\n  issuer: https://l.example\n"
                                             "  client_id: x\n  roles: {a: admin}\n"
                                             "  redirect_url: https://llmgw.example/auth/callback\n"))
    assert behind_tls.oidc is not None and behind_tls.oidc.redirect_url == "https://llmgw.example/auth/callback"
