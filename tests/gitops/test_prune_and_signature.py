"""Pure parts of GitOps: the prune guard's judgement and the webhook signature check."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from llmgw.catalog import read_directory, validate_files
from llmgw.gitops.prune import allows_prune, judge_prune
from llmgw.gitops.webhook import signature_ok
from tests.catalog.corpus import write_catalog


def _catalog(tmp_path: Path, name: str, files: dict[str, str | None] | None = None):
    result = validate_files(read_directory(write_catalog(tmp_path / name, files)))
    assert result.catalog is not None, result.problems
    return result.catalog


def test_removing_most_models_is_held(tmp_path: Path) -> None:
    old = _catalog(tmp_path, "old")
    new = _catalog(tmp_path, "new", {"models/big.yaml": None, "models/small.yaml": None})
    verdict = judge_prune(old, new, {})
    assert verdict.held
    assert verdict.models_removed == ("big", "small")
    assert verdict.reasons == ("removes 2 of 2 models (more than 50%): big, small",)


def test_removing_one_of_two_models_is_not_more_than_half(tmp_path: Path) -> None:
    old = _catalog(tmp_path, "old")
    new = _catalog(tmp_path, "new", {"models/big.yaml": None})
    assert not judge_prune(old, new, {}).held


def test_stopping_most_ready_replicas_is_held(tmp_path: Path) -> None:
    old = _catalog(tmp_path, "old")
    # small keeps existing, but its max drops from 2 to 1 while 2 replicas are ready,
    # and big goes away with its 1: 2 of 3 ready replicas would stop.
    new = _catalog(tmp_path, "new", {
        "models/big.yaml": None,
        "models/small.yaml": (tmp_path / "old/models/small.yaml").read_text().replace("max: 2", "max: 1"),
    })
    verdict = judge_prune(old, new, {"small": 2, "big": 1})
    assert verdict.held
    assert verdict.replicas_stopped == 2
    assert verdict.reasons == ("stops 2 of 3 ready replicas (more than 50%)",)


def test_first_catalog_is_never_held(tmp_path: Path) -> None:
    assert not judge_prune(None, _catalog(tmp_path, "new"), {}).held


def test_trailer() -> None:
    assert allows_prune("Remove everything\n\nLlmgw-Allow-Prune: yes\n")
    assert not allows_prune("Remove everything\n\nLlmgw-Allow-Prune: no\n")
    assert not allows_prune("mentions Llmgw-Allow-Prune: yes in the middle of a line")


def test_signatures_github_and_gitea() -> None:
    secret, body = b"s3cret", b'{"ref": "refs/heads/main"}'
    digest = hmac.new(secret, body, hashlib.sha256).hexdigest()
    assert signature_ok(secret, body, {"X-Hub-Signature-256": f"sha256={digest}"})
    assert signature_ok(secret, body, {"X-Gitea-Signature": digest})
    assert not signature_ok(secret, body, {"X-Hub-Signature-256": digest})  # missing the sha256= prefix
    assert not signature_ok(secret, body + b" ", {"X-Gitea-Signature": digest})
    assert not signature_ok(secret, body, {})
