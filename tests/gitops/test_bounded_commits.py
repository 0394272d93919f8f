"""A commit is bounded before it is read: a catalog of too many files, or too many bytes in all,
is rejected from the tree listing alone, no blob read and nothing parsed. Seen: 50 model files
of ~1 MiB each took the controller from 230 MB to 1.8 GB and held the next good commit 133 s."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from pathlib import Path

import pytest

from llmgw.catalog import read_directory, validate_files
from llmgw.catalog.loader import MAX_CATALOG_BYTES, MAX_CATALOG_FILES, MAX_FILE_BYTES, MAX_PROBLEMS, RawFile
from llmgw.gitops.gitcli import read_tree
from tests.catalog.corpus import SMALL
from tests.conftest import git
from tests.e2e.processes import free_port, start, stop, wait_for
from tests.gitops.conftest import Remote, make_follower

MIB = 1024 * 1024


def hostile_model(i: int) -> str:
    """A model file just under the per-file cap, holding as many YAML values as the parser's own
    bound lets through (200,000): the most expensive thing to parse each file's limits allow."""
    head = (f"name: hostile-{i}\nsource: hf://org/x@v1\nsize_gb: 1\n"
            "profiles:\n  - name: p\n    engine: vllm\n    gpus: 1\n")
    text = head + "    args: [" + ",".join(["abcd"] * 190_000) + "]\n"
    assert len(text) < MAX_FILE_BYTES
    return text


def small_model(i: int) -> str:
    return SMALL.replace("name: small", f"name: m{i}").replace("aliases: [tiny]", f"aliases: [tiny-{i}]")


def hostile_files(count: int = 50) -> dict[str, str]:
    return {f"models/hostile-{i}.yaml": hostile_model(i) for i in range(count)}


def wrong_values_files(count: int = 4) -> dict[str, str]:
    """Within every bound (4 files, under 4 MiB in all), each value of them a schema problem."""
    return {f"models/wrong-{i}.yaml": hostile_model(i).replace("abcd", "1") for i in range(count)}


def test_a_validation_reports_at_most_a_thousand_problems() -> None:
    bad = "name: m{i}\nsource: 1\nsize_gb: x\nscaling: 3\nprofiles: 4\nfallbacks: 5\naliases: 6\n"
    files = {f"models/m{i:03}.yaml": RawFile(f"models/m{i:03}.yaml", bad.format(i=i).encode(), 80) for i in range(300)}
    files["nodes.yaml"] = RawFile("nodes.yaml", b"nodes: []\n", 10)
    problems = validate_files(files).problems
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[-1].message.startswith("and ") and "more problems from here on, not shown" in problems[-1].message


def test_a_file_of_a_hundred_thousand_problems_reports_the_first_fifty(remote: Remote) -> None:
    """Each wrong value is a problem: finding, describing and storing 760,000 of them had taken
    58 s and 900 MB; one file's first problems say what is wrong with it."""
    sha = remote.commit(wrong_values_files(1), "One file of wrong values")
    problems = validate_files(read_tree(remote.bare, sha)).problems
    assert len(problems) == 51
    assert "more than 50 problems in this file" in str(problems[0]) and str(problems[0]).startswith("models/wrong-0")
    assert "profiles[0].args[0]: expected a string, got number 1" in str(problems[1])


def test_too_many_bytes_in_all_is_one_problem_naming_the_limit_and_the_figures(remote: Remote) -> None:
    sha = remote.commit(hostile_files(), "Fifty files just under a MiB each")
    files = read_tree(remote.bare, sha)
    assert all(f.data == b"" for f in files.values())  # nothing was read
    result = validate_files(files)
    [problem] = result.problems
    total = sum(f.size for f in files.values())
    assert problem.file.startswith("models/hostile-") and problem.line == 1
    assert f"{total / MIB:.1f} MiB" in problem.message
    assert f"at most {MAX_CATALOG_BYTES // MIB} MiB" in problem.message, problem.message
    assert f"{len(files)} files" in problem.message, problem.message


def test_too_many_files_is_one_problem_naming_the_limit_and_the_count(remote: Remote) -> None:
    count = MAX_CATALOG_FILES + 1
    sha = remote.commit({f"models/m{i}.yaml": small_model(i) for i in range(count)}, "Too many models")
    files = read_tree(remote.bare, sha)
    assert all(f.data == b"" for f in files.values())
    [problem] = validate_files(files).problems
    assert problem.file == "models" and problem.line == 1
    assert f"at most {MAX_CATALOG_FILES:,} files" in problem.message
    assert f"{len(files):,} files" in problem.message and len(files) > count, problem.message


def test_a_models_directory_listing_beyond_the_bound_is_not_even_listed_in_full(remote: Remote) -> None:
    """Entries that are no catalog file (a README per model, ten thousand of them) are listed, not
    read; their listing is bounded too, or a tree of a million names costs the controller its memory."""
    sha = remote.commit({f"models/notes-{i:05}.md": "x" for i in range(3 * MAX_CATALOG_FILES)}, "Many notes")
    files = read_tree(remote.bare, sha)
    assert len(files) <= MAX_CATALOG_FILES + 4
    [problem] = validate_files(files).problems
    assert problem.file == "models" and f"at most {MAX_CATALOG_FILES:,}" in problem.message, problem


def test_the_working_tree_reader_is_bounded_the_same_way(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "nodes.yaml").write_text("nodes: []\n")
    for rel, text in hostile_files(8).items():
        (tmp_path / rel).write_text(text)
    files = read_directory(tmp_path)
    assert all(f.data == b"" for f in files.values())
    [problem] = validate_files(files).problems
    assert f"at most {MAX_CATALOG_BYTES // MIB} MiB" in problem.message


def test_the_follower_rejects_a_hostile_commit_and_applies_the_next_good_one(remote: Remote, tmp_path: Path) -> None:
    asyncio.run(_hostile_then_good(remote, tmp_path))


async def _hostile_then_good(remote: Remote, tmp_path: Path) -> None:
    follower = make_follower(remote, tmp_path / "data")
    await follower.start()
    try:
        first = await follower.sync_once()
        assert first.state.value == "synced"
        bad = remote.commit(hostile_files(), "Fifty hostile files")
        status = await follower.sync_once()
        assert status.state.value == "rejected" and status.rejected is not None and status.rejected.sha == bad
        assert "a catalog may hold at most" in str(status.rejected.problems[0])
        assert status.applied_sha == first.applied_sha
        events = [e for e in follower.store.events() if e.kind == "rejected"]
        assert events and "MiB" in events[-1].message
        good = remote.commit({**{k: None for k in hostile_files()}, "models/m1.yaml": small_model(1)}, "Good again")
        status = await follower.sync_once()
        assert status.state.value == "synced" and status.applied_sha == good
    finally:
        await follower.close()


# ---------------------------------------------------------------------------------------------
# The controller process itself: its peak memory over a hostile commit


TOKEN = "bounded-commit-token"


def settings(round_: int) -> str:
    return f"# round {round_}\npools:\n  - name: default\n"


def _sync(admin: str) -> dict:
    req = urllib.request.Request(admin + "/api/v1/sync", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc status")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hostile_commit_leaves_the_controllers_peak_memory_flat(tmp_path: Path) -> None:
    """`llmgw controller` as an operator runs it, on a fleet of no nodes (nothing to reach): only
    its git loop works. Before the bound, the same commit was parsed for 90 s and more."""
    bare = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(bare))
    remote = Remote(bare, tmp_path / "person")
    remote.clone.mkdir()
    git(remote.clone, "init", "-q", "-b", "main")
    git(remote.clone, "remote", "add", "origin", str(bare))
    initial = remote.commit({"nodes.yaml": "nodes: []\n", "llmgw.yaml": settings(0)}, "An empty fleet")
    admin_port = free_port()
    config = tmp_path / "controller.yaml"
    config.write_text(json.dumps({
        "repo": str(bare), "data_dir": str(tmp_path / "data"), "fetch_interval": 3600, "watch": False,
        "listen": {"router": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{admin_port}"},
        "admin_token": TOKEN,
    }))
    admin = f"http://127.0.0.1:{admin_port}"
    proc = start(["controller", "--config", str(config)], tmp_path / "controller.log")

    def synced_on(sha: str) -> bool:
        s = _sync(admin)
        return s["state"] == "synced" and s["applied_sha"] == sha

    def trigger() -> None:
        req = urllib.request.Request(admin + "/api/v1/sync", data=b"{}", method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        urllib.request.urlopen(req, timeout=120).read()

    try:
        wait_for(lambda: synced_on(initial), 60, "the initial catalog applied", proc)
        # One ordinary commit first, so the baseline includes what judging any commit costs.
        warm = remote.commit({"llmgw.yaml": settings(1)}, "An ordinary commit")
        trigger()
        wait_for(lambda: synced_on(warm), 60, "an ordinary commit applied", proc)
        baseline = _peak_rss_kib(proc.pid)
        bad = remote.commit(hostile_files(), "Fifty hostile files")
        trigger()
        rejected = wait_for(lambda: (s := _sync(admin))["state"] == "rejected" and s, 120, "the hostile commit", proc)
        hostile_growth_mib = (_peak_rss_kib(proc.pid) - baseline) / 1024
        print(f"controller peak RSS: baseline {baseline / 1024:.0f} MiB, growth over the hostile commit "
              f"{hostile_growth_mib:.1f} MiB")
        assert rejected["rejected"]["sha"] == bad
        assert "a catalog may hold at most" in rejected["rejected"]["problems"][0]["message"]
        good = remote.commit({**{k: None for k in hostile_files()}, "llmgw.yaml": settings(2)}, "Good again")
        trigger()
        wait_for(lambda: synced_on(good), 60, "the next good commit applied", proc)
        # Within every bound, the worst a commit can be: parsed (one file at a time), its problems counted out.
        within = remote.commit(wrong_values_files(), "Four files of wrong values")
        trigger()
        rejected = wait_for(lambda: (s := _sync(admin))["state"] == "rejected" and s, 120, "the second one", proc)
        assert rejected["rejected"]["sha"] == within and len(rejected["rejected"]["problems"]) == 4 * 51
        within_growth_mib = (_peak_rss_kib(proc.pid) - baseline) / 1024
        print(f"growth over a commit within the bounds: {within_growth_mib:.1f} MiB")
        # One 1 MiB file of 190,000 values parsed with their positions costs ~130 MiB (measured 132),
        # whatever the number of files: they are parsed one at a time.
        assert within_growth_mib < 200
        good = remote.commit({**{k: None for k in wrong_values_files()}, "llmgw.yaml": settings(3)}, "Good")
        trigger()
        wait_for(lambda: synced_on(good), 60, "the next good commit applied", proc)
        assert hostile_growth_mib < 150
        assert (_peak_rss_kib(proc.pid) - baseline) / 1024 < 150
    finally:
        stop(proc, signal.SIGTERM)
