"""`llmgw diff` golden outputs over scenarios built as real commits in a real repository.

Set LLMGW_UPDATE_GOLDEN=1 to rewrite the golden files after a deliberate change, then
read the diff of tests/plan/golden/ before committing it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.catalog import read_directory, validate_files
from tests.conftest import git
from tests.plan.scenarios import CHAT, EMBED, FIXED_DATES, base_repo, fleet, model

GOLDEN = Path(__file__).parent / "golden"


@dataclass
class Scenario:
    name: str
    files: dict[str, str | None]
    message: str = "change"
    commit: bool = True
    exit_code: int = 2


SCENARIOS = [
    Scenario("add-model", {"models/qwen.yaml": model("qwen", "hf://org/qwen@v2", size=20)}, "Add qwen"),
    Scenario("remove-model", {"models/old.yaml": None}, "Remove old"),
    Scenario("raise-min", {"models/chat.yaml": CHAT.replace("min: 1", "min: 2")}, "Two chat replicas"),
    Scenario("replace-args", {"models/chat.yaml": CHAT + '    args: ["--ttft", "0.05"]\n'}, "Slower chat"),
    Scenario("alias-collision", {"models/embed.yaml": EMBED.replace("source:", "aliases: [gpt-4o-mini]\nsource:")},
             "Alias embed", exit_code=1),
    # Two replicas of 2 GPUs each: n3 holds one, no node has room for the second.
    Scenario("unplaceable", {"models/huge.yaml": model("huge", "hf://org/huge@v1", gpus=2, min_=2, size=50)},
             "Add huge"),
    Scenario("orphans", {"models/embed.yaml": None}, "Remove embed"),
    Scenario("prune-guard", {"models/chat.yaml": None, "models/embed.yaml": None, "models/old.yaml": None},
             "Remove every model"),
    # Every node gone from nodes.yaml: every replica stops, so the guard holds it (seen: applied).
    Scenario("empty-nodes", {"nodes.yaml": "nodes: []\n"}, "Empty nodes.yaml"),
    Scenario("no-change", {}, "Nothing", exit_code=0),
    Scenario("uncommitted", {"models/chat.yaml": CHAT.replace("max: 2", "max: 3")}, commit=False),
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return base_repo(tmp_path_factory.mktemp("diff") / "catalog")


@pytest.fixture(scope="module")
def snapshot(repo: Path, tmp_path_factory) -> Path:
    result = validate_files(read_directory(repo))
    assert result.catalog is not None, result.problems
    path = tmp_path_factory.mktemp("fleet") / "fleet.json"
    path.write_text(json.dumps(fleet(result.catalog).to_json()))
    return path


def apply(repo: Path, s: Scenario) -> list[str]:
    git(repo, "checkout", "-q", "-B", f"s-{s.name}", "base")
    git(repo, "reset", "-q", "--hard", "base")
    for rel, text in s.files.items():
        if text is None:
            (repo / rel).unlink()
        else:
            (repo / rel).write_text(text)
    if s.commit:
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "--allow-empty", "-m", s.message, env=FIXED_DATES)
        return ["base", "HEAD"]
    return ["base"]


@pytest.mark.parametrize("fmt,ext", [("text", "txt"), ("markdown", "md"), ("json", "json")])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_golden(run_cli, repo: Path, snapshot: Path, scenario: Scenario, fmt: str, ext: str) -> None:
    revs = apply(repo, scenario)
    code, out = run_cli("diff", *revs, "--repo", str(repo), "--snapshot", str(snapshot), "--format", fmt)
    assert code == scenario.exit_code, out
    golden = GOLDEN / f"{scenario.name}.{ext}"
    if os.environ.get("LLMGW_UPDATE_GOLDEN"):
        golden.write_text(out)
    assert out == golden.read_text()


def test_every_scenario_changes_what_it_says(run_cli, repo: Path, snapshot: Path) -> None:
    """The golden files are read by a person once; these are the facts they must show."""

    def plan(s: Scenario) -> dict:
        revs = apply(repo, s)
        return json.loads(run_cli("diff", *revs, "--repo", str(repo), "--snapshot", str(snapshot),
                                  "--format", "json")[1])

    by = {s.name: s for s in SCENARIOS}
    p = plan(by["add-model"])
    assert [(x["action"], x["model"], x["shards"]) for x in p["plan"]["steps"]] == [
        ("start", "qwen", [{"node": "n2", "gpus": [1]}])]
    assert p["plan"]["fetches"] == [{"node": "n2", "model": "qwen", "gb": 20, "source": "hf://org/qwen@v2"}]
    assert p["summary"] == "Plan: 1 to start, 0 to stop, 0 unplaceable."
    p = plan(by["remove-model"])
    assert [(x["action"], x["replica"]) for x in p["plan"]["steps"]] == [("stop", "old-g3")]
    assert p["plan"]["new_orphans"] == []  # an operator's copy is never an orphan
    p = plan(by["replace-args"])
    assert [(x["action"], x["replica"]) for x in p["plan"]["steps"]] == [("replace", "chat-g1")]
    assert p["summary"] == "Plan: 0 to start, 1 to replace, 0 to stop, 0 unplaceable."
    p = plan(by["alias-collision"])
    assert [x["message"] for x in p["problems"]] == [
        'alias "gpt-4o-mini" is already the alias of model "chat" (models/chat.yaml:1)']
    assert p["plan"]["steps"] == []  # embed's broken file counts as unchanged: nothing stops
    p = plan(by["unplaceable"])
    assert p["plan"]["unplaceable"]["huge"]["replicas"] == 1
    assert [(x["action"], x["shards"]) for x in p["plan"]["steps"]] == [("start", [{"node": "n3", "gpus": [0, 1]}])]
    assert [(r["node"], r["reason"]) for r in p["plan"]["unplaceable"]["huge"]["rejections"]] == [
        ("n1", "needs 2 free GPUs of class sim, has 0 (of 2: 2 in use)"),
        ("n2", "needs 2 free GPUs of class sim, has 1 (of 2: 1 in use)"),
        ("n3", "needs 2 free GPUs of class sim, has 0 (of 2: 2 in use)")]
    p = plan(by["orphans"])
    assert [o["node"] for o in p["plan"]["new_orphans"]] == ["n1"]
    p = plan(by["prune-guard"])
    assert p["plan"]["prune_guard"]["held"] is True
    assert p["summary"] == "Plan: 0 to start, 3 to stop, 0 unplaceable."
    p = plan(by["no-change"])
    assert p["summary"] == "No changes." and p["changes"] == []
    p = plan(by["uncommitted"])
    assert p["head"] == "working tree"
    assert p["changes"][0]["fields"] == [{"path": "scaling.max", "before": 2, "after": 3}]


def test_markdown_stays_under_a_pr_comment_limit() -> None:
    from llmgw.plan.changes import Change, FieldChange
    from llmgw.plan.render import MARKDOWN_LIMIT, DiffReport, render_markdown

    changes = tuple(Change("model", f"model-{i}", "~", tuple(FieldChange(f"field{j}", "a" * 40, "b" * 40)
                                                             for j in range(20))) for i in range(200))
    text = render_markdown(DiffReport("base", "head", changes, (), None))
    assert len(text) <= MARKDOWN_LIMIT
    assert text.rstrip().endswith("run `llmgw diff` locally._")


def test_ci_examples_parse_and_run_validate_and_diff() -> None:
    import yaml

    from tests.conftest import REPO_ROOT

    for path in ("examples/ci/.github/workflows/llmgw.yaml", "examples/ci/.gitea/workflows/llmgw.yaml"):
        flow = yaml.safe_load((REPO_ROOT / path).read_text())
        steps = " ".join(str(s.get("run", "")) for s in flow["jobs"]["plan"]["steps"])
        assert "llmgw validate" in steps and "llmgw diff" in steps and "--format markdown" in steps
    hooks = yaml.safe_load((REPO_ROOT / "examples/ci/.pre-commit-config.yaml").read_text())
    assert hooks["repos"][0]["hooks"][0]["id"] == "llmgw-validate"


def test_a_tenants_limits_change_shows_field_by_field(run_cli, repo: Path, snapshot: Path) -> None:
    """Two commits of llmgw.yaml: what a reviewer must see is which limit of which tenant moved,
    and that no engine restarts for it."""
    settings = ("tenants:\n  - name: search\n    keys: [search-prod]\n    limits:\n"
                "      requests_per_minute: 600\n      concurrent: 16\n"
                "      budget: {tokens: 5000000, per: day}\n"
                "    models:\n      chat: {requests_per_minute: 30}\n")
    apply(repo, Scenario("tenants", {"llmgw.yaml": settings}, "Tenants"))
    (repo / "llmgw.yaml").write_text(settings.replace("concurrent: 16", "concurrent: 8")
                                     .replace("per: day}", "per: month, reset: \"06:00\"}")
                                     .replace("chat: {requests_per_minute: 30}", "chat: {tokens_per_minute: 9000}"))
    git(repo, "commit", "-q", "-am", "Tighter search", env=FIXED_DATES)
    code, out = run_cli("diff", "HEAD~1", "HEAD", "--repo", str(repo), "--snapshot", str(snapshot),
                        "--format", "json")
    p = json.loads(out)
    assert code == 2, out
    [change] = p["changes"]
    assert (change["kind"], change["name"], change["op"]) == ("settings", "llmgw.yaml", "~")
    assert {(f["path"], f["before"], f["after"]) for f in change["fields"]} == {
        ("tenants.search.limits.concurrent", 16, 8),
        ("tenants.search.limits.budget.per", "day", "month"),
        ("tenants.search.limits.budget.reset", "00:00", "06:00"),
        ("tenants.search.models.chat.requests_per_minute", 30, None),
        ("tenants.search.models.chat.tokens_per_minute", None, 9000)}
    assert p["plan"]["steps"] == []
    code, text = run_cli("diff", "HEAD~1", "HEAD", "--repo", str(repo), "--snapshot", str(snapshot))
    assert "tenants.search.limits.concurrent: 16 → 8" in text, text


def test_a_tenant_naming_a_key_the_controller_does_not_have_is_a_warning(run_cli, repo: Path, snapshot: Path,
                                                                        tmp_path: Path) -> None:
    """Keys live outside git (the controller's store and config): against a controller that says
    which it has, a tenant naming another is said in the plan (status says the same once applied)."""
    settings = "tenants:\n  - name: search\n    keys: [search-prod, serach-prod]\n"
    apply(repo, Scenario("tenants", {"llmgw.yaml": settings}, "Tenants"))
    fleet = json.loads(snapshot.read_text())
    with_keys = tmp_path / "fleet.json"
    with_keys.write_text(json.dumps({**fleet, "key_names": ["search-prod"]}))
    want = 'tenant "search" names key "serach-prod", which no API key has'
    code, out = run_cli("diff", "HEAD~1", "HEAD", "--repo", str(repo), "--snapshot", str(with_keys), "--format", "json")
    [warning] = json.loads(out)["warnings"]  # the key it has is not said
    assert want in warning, out
    code, text = run_cli("diff", "HEAD~1", "HEAD", "--repo", str(repo), "--snapshot", str(with_keys))
    assert f"warning: {want}" in text, text
    code, md = run_cli("diff", "HEAD~1", "HEAD", "--repo", str(repo), "--snapshot", str(with_keys),
                       "--format", "markdown")
    assert ":warning: tenant" in md and "serach" in md, md
    # A snapshot without key names (an older export, or CI's own): nothing said either way.
    code, out = run_cli("diff", "HEAD~1", "HEAD", "--repo", str(repo), "--snapshot", str(snapshot), "--format", "json")
    assert json.loads(out)["warnings"] == []
