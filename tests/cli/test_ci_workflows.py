"""The CI examples run as written: each workflow's `run:` steps, in order, with the runner's shell.

The report: `pip install llmgw` could not be resolved, the controller path exited 1
(`LLMGW_ADMIN_TOKEN is set but LLMGW_ADMIN_URL is not`, and diff had no --url) and the comment
step posted an empty comment anyway. Here each workflow YAML is parsed and each `run:` step's
shell is run with ``bash --noprofile --norc -eo pipefail`` (GitHub's and Gitea's default), the
environment the workflow gives it and ``${{ ... }}`` replaced by test values, in a clone of a real
catalog repository (a base commit on ``origin/main`` and a pull request's change on top),
planning against a real `llmgw controller` on real sshd nodes. Only three things are not the
runner's: the `uses:` steps (the clone is checked out already; this interpreter is the Python),
the pip install (llmgw is installed here already; the step's own guard is run on its own), and
GitHub's `gh pr comment` (the body file it would post is read instead; Gitea's API call runs, to
a local HTTP server that records it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.safetext import markdown
from tests.conftest import REPO_ROOT, git
from tests.e2e.processes import catalog_repo, controller_config, start, stop, wait_for
from tests.reconciler.fleet_e2e import sim_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # the fleet's start alone is ~15 s on a busy box

TOKEN = "ci-admin-token"
WORKFLOWS = {"github": REPO_ROOT / "examples/ci/.github/workflows/llmgw.yaml",
             "gitea": REPO_ROOT / "examples/ci/.gitea/workflows/llmgw.yaml"}
BIN = str(Path(sys.executable).parent)  # where `llmgw` is installed: the pip step's result
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
QWEN = sim_model("qwen", "sim://qwen", min_=1, max_=2)


# --- a comment API that records what it is sent -------------------------------------------------
@dataclass
class CommentApi:
    posts: list[tuple[str, str | None, Any]] = field(default_factory=list)  # (path, Authorization, body)
    url: str = ""


@pytest.fixture
def comment_api() -> Iterator[CommentApi]:
    api = CommentApi()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            api.posts.append((self.path, self.headers.get("Authorization"), json.loads(raw)))
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield api
    httpd.shutdown()
    httpd.server_close()


# --- the runner -----------------------------------------------------------------------------------
@dataclass
class JobRun:
    comment: str | None = None  # what the job posted (or would post) on the pull request
    posted_to: str | None = None
    failed: str | None = None  # the name of the step that failed, None when the job passed
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


def evaluate(expression: str, context: Mapping[str, Any]) -> str:
    """The one kind of expression the examples use: a dotted name (a missing secret is empty)."""
    if not re.fullmatch(r"[A-Za-z_][\w-]*(\.[\w-]+)+", expression):
        raise AssertionError(f"${{{{ {expression} }}}}: not an expression this test models")
    head, *rest = expression.split(".")
    value: Any = context[head]
    for part in rest:
        if head == "secrets" and part not in value:
            return ""
        value = value[part]
    return str(value)


def substitute(text: str, context: Mapping[str, Any]) -> str:
    return EXPR.sub(lambda m: evaluate(m.group(1), context), text)


def run_job(workflow: Path, workdir: Path, *, context: dict[str, Any], path: str | None = None) -> JobRun:
    """Run the job's steps as the runner would, stopping at the first that fails."""
    flow = yaml.safe_load(workflow.read_text())
    [job] = flow["jobs"].values()
    result = JobRun()
    context = {"secrets": {}, **context, "steps": {}}
    base_env = {"PATH": path or f"{BIN}:/usr/bin:/bin", "HOME": str(workdir.parent / "home"), "LANG": "C.UTF-8",
                "GIT_CONFIG_NOSYSTEM": "1"}
    for i, step in enumerate(job["steps"]):
        assert "if" not in step, "a step with a condition: the runner's `if:` is not modelled here"
        if "uses" in step:
            continue
        name = step.get("name", f"step {i}")
        script = step["run"]
        output = workdir.parent / f"output-{i}"
        output.write_text("")
        env = {**base_env, "GITHUB_OUTPUT": str(output),
               **{k: substitute(str(v), context) for k, v in {**flow.get("env", {}), **step.get("env", {})}.items()}}
        script = substitute(script, context)
        if "pip install" in script:
            continue  # llmgw is installed in this interpreter's environment already
        if "gh pr comment" in script:
            [body] = re.findall(r"--body-file (\S+)", script)
            result.comment = (workdir / body).read_text()
            result.posted_to = f"pull request {env['PR']}"
            continue
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script], cwd=workdir,
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        result.log.append(f"--- {name} (exit {proc.returncode})\n{proc.stdout}{proc.stderr}")
        outputs = dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)
        if "id" in step:
            result.outputs[step["id"]] = outputs
            context["steps"][step["id"]] = {"outputs": outputs}
        if proc.returncode != 0:
            result.failed = name
            break
    return result


def github(number: int = 7) -> dict[str, Any]:
    return {"github": {"base_ref": "main", "token": "gh-job-token", "event": {"pull_request": {"number": number}}}}


def gitea(api: CommentApi, number: int = 7) -> dict[str, Any]:
    return {"gitea": {"base_ref": "main", "server_url": api.url, "repository": "ops/catalog",
                      "event": {"pull_request": {"number": number}}},
            "secrets": {"GITEA_TOKEN": "gitea-job-token"}}


def posted(flavour: str, run: JobRun, api: CommentApi) -> str:
    """The comment the job posted, checked to be one, non-empty, on pull request 7."""
    if flavour == "github":
        assert run.posted_to == "pull request 7", run.log
        comment = run.comment
    else:
        [(where, auth, body)] = api.posts
        assert (where, auth) == ("/api/v1/repos/ops/catalog/issues/7/comments", "token gitea-job-token")
        comment = body["body"]
    assert comment and comment.strip(), run.log
    return comment


# --- the repositories and the controller --------------------------------------------------------
@dataclass
class Fleet:
    admin: str
    catalog: Path  # the repository the controller follows: the pull request's base
    log: Path


@pytest.fixture(scope="module")
def fleet(sshd_fleet, tmp_path_factory) -> Iterator[Fleet]:
    """A real `llmgw controller` following a catalog of one scaled-to-zero model on 2 sshd nodes."""
    nodes = sshd_fleet(2)
    tmp = tmp_path_factory.mktemp("ci")
    repo = catalog_repo(tmp, nodes, {"chat": sim_model("chat", "sim://chat", min_=0, max_=2)}, "Catalog")
    config, admin = controller_config(tmp, "controller", repo, nodes, TOKEN)
    log = tmp / "controller.log"
    proc = start(["controller", "--config", str(config)], log)
    try:
        def ready() -> bool:
            req = urllib.request.Request(admin + "/api/v1/nodes", headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                listed = json.loads(r.read())
            return len(listed) == 2 and all(n["state"] == "ready" for n in listed)

        wait_for(ready, 60, "both nodes ready", proc)
        yield Fleet(admin, repo, log)
    finally:
        stop(proc, signal.SIGTERM)


def pull_request(fleet: Fleet, tmp: Path, files: Mapping[str, str]) -> Path:
    """The runner's checkout: a clone whose origin/main is the base, HEAD the change."""
    work = tmp / "checkout"
    git(tmp, "clone", "-q", str(fleet.catalog), str(work))
    git(work, "checkout", "-q", "-b", "change")
    for rel, text in files.items():
        (work / rel).write_text(text)
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "Pull request")
    (tmp / "home").mkdir()
    return work


# --- the tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", WORKFLOWS)
def test_the_plan_against_the_live_controller_is_posted(flavour: str, fleet: Fleet, tmp_path: Path,
                                                       comment_api: CommentApi) -> None:
    work = pull_request(fleet, tmp_path, {"models/qwen.yaml": QWEN})
    secrets = {"LLMGW_ADMIN_URL": fleet.admin, "LLMGW_ADMIN_TOKEN": TOKEN}
    context = github() if flavour == "github" else gitea(comment_api)
    context["secrets"] = {**context.get("secrets", {}), **secrets}
    run = run_job(WORKFLOWS[flavour], work, context=context)
    assert run.failed is None, run.log
    assert run.outputs["plan"] == {"exit": "2"}
    comment = posted(flavour, run, comment_api)
    assert comment.startswith("### llmgw diff <code>origin/main")
    assert "**Plan: 1 to start, 0 to stop, 0 unplaceable.**" in comment
    assert "<code>+</code> model <b>qwen</b>" in comment  # the change, by name
    # The address is a workflow secret and the comment public: named by its variable, not shown.
    assert f"#### Plan against the fleet (live fleet at {markdown('$LLMGW_ADMIN_URL')})" in comment
    assert fleet.admin.split("://")[1] not in comment
    assert "| start | qwen/sim |" in comment
    assert TOKEN not in comment and TOKEN not in "".join(run.log)


@pytest.mark.parametrize("flavour", WORKFLOWS)
def test_without_secrets_the_committed_snapshot_is_the_fleet(flavour: str, fleet: Fleet, tmp_path: Path,
                                                            comment_api: CommentApi) -> None:
    snapshot = subprocess.run([f"{BIN}/llmgw", "inventory", "export", "-f", "-", "--url", fleet.admin],
                              env={**os.environ, "LLMGW_ADMIN_TOKEN": TOKEN}, capture_output=True, text=True,
                              timeout=60, check=True).stdout
    work = pull_request(fleet, tmp_path, {"models/qwen.yaml": QWEN, "fleet.json": snapshot})
    context = github() if flavour == "github" else gitea(comment_api)
    run = run_job(WORKFLOWS[flavour], work, context=context)  # the secrets are not set: a fork's PR
    assert run.failed is None, run.log
    comment = posted(flavour, run, comment_api)
    assert "#### Plan against the fleet (snapshot fleet.json)" in comment
    assert "**Plan: 1 to start, 0 to stop, 0 unplaceable.**" in comment and "<b>qwen</b>" in comment


def test_without_any_fleet_the_catalog_change_is_still_posted(fleet: Fleet, tmp_path: Path) -> None:
    work = pull_request(fleet, tmp_path, {"models/qwen.yaml": QWEN})
    run = run_job(WORKFLOWS["github"], work, context=github())
    assert run.failed is None, run.log
    comment = posted("github", run, CommentApi())
    assert "**Plan: 1 catalog change, no fleet to plan against.**" in comment and "<b>qwen</b>" in comment
    assert "No fleet given: pass `--url URL` (with `--token`) or `--snapshot FILE`." in comment


@pytest.mark.parametrize("flavour", WORKFLOWS)
def test_a_diff_that_fails_posts_why_and_fails_the_job(flavour: str, fleet: Fleet, tmp_path: Path,
                                                      comment_api: CommentApi) -> None:
    work = pull_request(fleet, tmp_path, {"models/qwen.yaml": QWEN})
    context = github() if flavour == "github" else gitea(comment_api)
    context["secrets"] = {**context.get("secrets", {}), "LLMGW_ADMIN_URL": fleet.admin,
                          "LLMGW_ADMIN_TOKEN": "a-revoked-token"}
    run = run_job(WORKFLOWS[flavour], work, context=context)
    assert run.failed == "Verdict", run.log  # after the comment was posted
    assert run.outputs["plan"] == {"exit": "1"}
    comment = posted(flavour, run, comment_api)
    assert comment.startswith("### :x: llmgw diff could not run")
    assert "the controller at $LLMGW_ADMIN_URL refused the admin token from $LLMGW_ADMIN_TOKEN" in comment
    assert "::error::llmgw diff failed (exit 1)" in run.log[-1]
    assert "a-revoked-token" not in comment


def test_an_invalid_catalog_is_posted_with_its_problems_and_fails_the_job(fleet: Fleet, tmp_path: Path) -> None:
    work = pull_request(fleet, tmp_path, {"models/qwen.yaml": QWEN.replace("max: 2", "max: 0")})
    run = run_job(WORKFLOWS["github"], work, context=github())
    assert run.failed == "Verdict" and run.outputs["plan"] == {"exit": "1"}, run.log
    comment = posted("github", run, CommentApi())
    assert "#### :x: Validation" in comment and "<code>models/qwen.yaml&#58;" in comment
    assert "models/qwen.yaml:" in run.log[-1]  # `llmgw validate` in the job's log, file:line


def test_llmgw_missing_still_posts_a_comment_that_says_so(fleet: Fleet, tmp_path: Path) -> None:
    """The install step skipped or broken: diff never ran, and the comment says that, not nothing."""
    work = pull_request(fleet, tmp_path, {"models/qwen.yaml": QWEN})
    run = run_job(WORKFLOWS["github"], work, context=github(), path="/usr/bin:/bin")
    assert run.outputs["plan"] == {"exit": "127"}, run.log
    comment = posted("github", run, CommentApi())
    assert comment.startswith("### :x: llmgw diff exited 127 without a plan")
    assert "llmgw: command not found" in comment
    assert run.failed == "Verdict"


@pytest.mark.parametrize("flavour", WORKFLOWS)
def test_the_install_step_stops_at_the_placeholder_and_says_what_to_set(flavour: str, tmp_path: Path) -> None:
    flow = yaml.safe_load(WORKFLOWS[flavour].read_text())
    [step] = [s for s in next(iter(flow["jobs"].values()))["steps"] if "pip install" in s.get("run", "")]
    assert flow["env"]["LLMGW_INSTALL"].startswith("llmgw @ git+https://")
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "LLMGW_INSTALL": flow["env"]["LLMGW_INSTALL"]},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stdout.startswith("::error::LLMGW_INSTALL still names <org>: set it"), proc.stdout + proc.stderr
