"""fetch: detached downloads into `<cache_dir>/llmgw-<sha256(source)>`, progress in status, joins,
resumes; and the inventory of what ends up on disk."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from types import ModuleType

import pytest

from tests.agent.helpers import FileServer, Node, cache_name, make_entry, wait_for


def fetch_state(node: Node, name: str) -> dict | None:
    return next((f for f in node.ok("status")["fetches"] if f["name"] == name), None)


def test_fetch_of_a_file_url_lands_as_a_complete_entry(node: Node) -> None:
    data = os.urandom(300_000)
    src = node.root / "src" / "model.gguf"
    src.parent.mkdir()
    src.write_bytes(data)
    source = f"file://{src}"
    first = node.ok("fetch", {"source": source})
    assert first["name"] == cache_name(source)
    assert first["path"] == str(node.cache / cache_name(source))
    assert first["state"] in ("running", "done")
    done = node.fetch_until_done(source)
    assert (done["bytes_done"], done["bytes_total"], done["error"]) == (len(data), len(data), None)
    entry = node.cache / cache_name(source)
    assert (entry / "model.gguf").read_bytes() == data
    manifest = json.loads((entry / "llmgw-manifest.json").read_text())
    assert manifest["source"] == source and manifest["bytes"] == len(data) and manifest["agent_version"] == "0.1.0"
    assert not list(node.cache.glob(".tmp-*"))
    assert fetch_state(node, cache_name(source))["state"] == "done"


def test_fetch_of_a_directory_copies_the_tree_and_dereferences_file_links(node: Node) -> None:
    src = node.root / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "shard-1.bin").write_bytes(b"1" * 1000)
    (node.root / "elsewhere.bin").write_bytes(b"2" * 10)
    (src / "linked.bin").symlink_to(node.root / "elsewhere.bin")
    source = str(src)  # a plain absolute path outside model_dirs is fetched like file://
    node.fetch_until_done(source)
    entry = node.cache / cache_name(source)
    assert sorted(str(p.relative_to(entry)) for p in entry.rglob("*")) == [  # with the chunk list other nodes check
        "config.json", "linked.bin", "llmgw-chunks.json", "llmgw-manifest.json", "sub", "sub/shard-1.bin"]
    chunks = json.loads((entry / "llmgw-chunks.json").read_text())
    assert [(f["path"], f["size"]) for f in chunks["files"]] == [
        ("config.json", 2), ("linked.bin", 10), ("sub/shard-1.bin", 1000)]
    assert not (entry / "linked.bin").is_symlink()
    assert (entry / "linked.bin").read_bytes() == b"2" * 10


def test_a_path_inside_model_dirs_is_the_operators_copy_and_is_not_copied(node: Node) -> None:
    own = node.models / "llama-8b"
    own.mkdir()
    (own / "weights.bin").write_bytes(b"w" * 100)
    answer = node.ok("fetch", {"source": str(own)})
    assert answer["state"] == "done" and answer["operator_copy"] is True
    assert answer["name"] is None and answer["path"] == str(own)
    assert list(node.cache.iterdir()) == []
    missing = node.ok("fetch", {"source": str(node.models / "absent")})
    assert missing["state"] == "failed" and "does not exist" in missing["error"]


def test_fetch_of_a_complete_entry_is_done_at_once(node: Node) -> None:
    make_entry(node.cache, "hf://org/model")
    answer = node.ok("fetch", {"source": "hf://org/model"})
    assert answer["state"] == "done" and answer["bytes_total"] == 64


@pytest.mark.parametrize("source", ["file:///tmp/x; rm -rf /", "/tmp/a b", "https://h/x?sig=$(id)", "/tmp/`id`",
                                    "relative/path", "ftp://host/x", "file://otherhost/x", "/tmp/../etc/passwd",
                                    "hf://only-one-part"])
def test_fetch_refuses_bad_sources(node: Node, agent_module: ModuleType, source: str) -> None:
    with pytest.raises(agent_module.AgentError, match="^fetch: "):
        agent_module.run_verb("fetch", str(node.config), {"source": source})
    assert list(node.cache.iterdir()) == []


def test_fetch_refusal_is_an_error_answer(node: Node) -> None:
    _, error = node.fail("fetch", {"source": "file:///tmp/x;reboot"})
    assert error == "fetch: source contains whitespace or shell metacharacters; refused"


@pytest.mark.skipif(importlib.util.find_spec("huggingface_hub") is not None, reason="huggingface_hub is installed")
def test_hf_source_without_huggingface_hub_fails_with_the_install_hint(node: Node) -> None:
    answer = node.ok("fetch", {"source": "hf://org/repo@main"})
    assert answer["state"] == "failed"
    assert answer["error"] == ("hf:// sources need the huggingface_hub package on the node: "
                               "pip install huggingface_hub")
    assert fetch_state(node, answer["name"])["state"] == "failed"


def test_fetch_over_http(node: Node, file_server: FileServer) -> None:
    data = os.urandom(200_000)
    file_server.files["/models/tiny.gguf"] = data
    source = f"{file_server.url}/models/tiny.gguf"
    node.fetch_until_done(source)
    assert (node.cache / cache_name(source) / "tiny.gguf").read_bytes() == data


def test_http_fetch_resumes_a_partial_download_with_a_range_request(node: Node, file_server: FileServer) -> None:
    data = os.urandom(100_000)
    file_server.files["/w.bin"] = data
    source = f"{file_server.url}/w.bin"
    partial = node.cache / f".tmp-{cache_name(source)}"
    partial.mkdir()
    (partial / "w.bin").write_bytes(data[:30_000])
    node.fetch_until_done(source)
    assert (node.cache / cache_name(source) / "w.bin").read_bytes() == data
    assert file_server.requests == [("/w.bin", "bytes=30000-")]


def test_http_fetch_failure_is_reported(node: Node, file_server: FileServer) -> None:
    answer = node.ok("fetch", {"source": f"{file_server.url}/missing.bin"})

    def failed() -> dict | None:
        state = fetch_state(node, answer["name"])
        return state if state and state["state"] == "failed" else None

    assert "HTTP 404" in wait_for(failed)["error"]
    assert not (node.cache / answer["name"]).exists()


def test_second_fetch_joins_the_running_one_and_status_shows_progress(node: Node, file_server: FileServer) -> None:
    data = os.urandom(400_000)
    file_server.files["/slow.bin"] = data
    gate = file_server.hold["/slow.bin"] = threading.Event()
    source = f"{file_server.url}/slow.bin"
    assert node.ok("fetch", {"source": source})["state"] == "running"

    def moving() -> dict | None:
        state = fetch_state(node, cache_name(source))
        return state if state and state["bytes_done"] > 0 else None

    progress = wait_for(moving)
    assert progress["state"] == "running" and progress["bytes_total"] == len(data)
    assert progress["bytes_done"] <= len(data) // 2
    joined = node.ok("fetch", {"source": source})
    assert joined["state"] == "running" and joined["name"] == cache_name(source)
    gate.set()
    node.fetch_until_done(source)
    assert [path for path, _ in file_server.requests] == ["/slow.bin"]  # one download, not two
    assert (node.cache / cache_name(source) / "slow.bin").read_bytes() == data


def test_inventory_lists_weights_foreign_entries_and_filesystems(node: Node) -> None:
    mounts = node.root / "mounts"
    mounts.write_text(
        "/dev/sda1 / ext4 rw,relatime 0 0\n"
        f"filer:/export/cache {node.cache} nfs4 rw,vers=4.2 0 0\n"
        f"/dev/nvme0n1 {node.models} xfs rw 0 0\n"
    )
    node.write_config(mounts_file=str(mounts))
    entry = make_entry(node.cache, "https://example.com/a.gguf")
    make_entry(node.cache, "hf://org/wrong", manifest_source="hf://org/other")
    (node.cache / "operator-notes").mkdir()
    (node.models / "llama").mkdir()
    (node.cache / ".tmp-llmgw-0123").mkdir()

    inventory = node.ok("inventory")

    assert inventory["agent_version"] == "0.1.0" and inventory["hostname"]
    assert [(g["index"], g["class"], g["memory_gb"], g["declared"], g["healthy"], g["problems"])
            for g in inventory["gpus"]] == [(0, "h100", 80, True, True, []), (1, "h100", 80, True, True, [])]
    assert inventory["memory_mb"]["total"] > 0 and inventory["memory_mb"]["available"] > 0
    cache_fs, models_fs = inventory["filesystems"]
    assert (cache_fs["path"], cache_fs["mount_point"], cache_fs["fstype"], cache_fs["shared"]) == (
        str(node.cache), str(node.cache), "nfs4", True)
    assert (models_fs["fstype"], models_fs["shared"]) == ("xfs", False)
    assert cache_fs["total_bytes"] > 0 and cache_fs["free_bytes"] >= 0
    [weights] = inventory["weights"]
    assert weights["path"] == str(entry) and weights["source"] == "https://example.com/a.gguf"
    assert weights["bytes"] > 64 and weights["complete"] is True and weights["last_used"] > 0
    assert [w["reason"] for w in inventory["invalid_weights"]] == ["manifest source does not hash to the entry name"]
    assert inventory["foreign"] == [str(node.cache / "operator-notes"), str(node.models / "llama")]
    assert inventory["engines"] == [] and inventory["fetches"] == []


def test_inventory_reads_gpus_from_nvidia_smi_when_present(node: Node) -> None:
    smi = node.bin / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        "echo '0, NVIDIA H100 80GB HBM3, GPU-aaa, 81559, 1024, 0'\n"
        "echo '1, NVIDIA A100-SXM4-80GB, GPU-bbb, [N/A], 0, 3'\n"
        "echo '2, NVIDIA L40S, GPU-ccc, 46068, 0, [N/A]'\n"
    )
    smi.chmod(0o755)
    gpus = node.ok("inventory")["gpus"]
    assert [(g["index"], g["class"], g["uuid"], g["declared"], g["healthy"]) for g in gpus] == [
        (0, "h100", "GPU-aaa", False, True), (1, "a100", "GPU-bbb", False, False), (2, "l40s", "GPU-ccc", False, True)]
    assert gpus[0]["memory_gb"] == 85.5  # decimal GB: a card sold as 80GB meets gpu_memory_gb: 80
    assert gpus[1]["problems"] == ["[N/A] reported for memory.total", "ecc errors: 3"]


def test_inventory_reports_a_failing_nvidia_smi_instead_of_declared_gpus(node: Node) -> None:
    smi = node.bin / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\n"
                   "exit 9\n")
    smi.chmod(0o755)
    inventory = node.ok("inventory")
    assert inventory["gpus"] == []
    assert inventory["gpu_error"].startswith("nvidia-smi exited with 9: NVIDIA-SMI has failed")


@pytest.mark.parametrize(("name", "expected"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s"),
    ("Tesla T4", "t4"), ("NVIDIA A10", "a10"), ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA RTX A6000", "a6000"),
])
def test_gpu_class_from_the_marketing_name(agent_module: object, name: str, expected: str) -> None:
    assert agent_module.gpu_class(name) == expected  # type: ignore[attr-defined]


def test_http_fetch_with_a_partial_file_the_server_will_not_resume_starts_over(node: Node,
                                                                               file_server: FileServer) -> None:
    data = os.urandom(10_000)
    file_server.files["/nr.bin"] = data
    source = f"{file_server.url}/nr.bin"
    partial = node.cache / f".tmp-{cache_name(source)}"
    partial.mkdir()
    (partial / "nr.bin").write_bytes(b"garbage" * 3000)  # longer than the file: the server answers 200
    node.fetch_until_done(source)
    assert (node.cache / cache_name(source) / "nr.bin").read_bytes() == data



def test_a_running_fetch_whose_worker_died_shows_as_failed(node: Node, agent_module: ModuleType) -> None:
    name = cache_name("https://example.com/x.bin")
    (node.state / "fetches").mkdir(parents=True)
    state = {"name": name, "path": str(node.cache / name), "source": "https://example.com/x.bin",
             "state": "running", "bytes_done": 10, "bytes_total": 100, "error": None, "updated_at": 0}
    (node.state / "fetches" / f"{name}.json").write_text(json.dumps(state))
    [view] = agent_module.run_verb("status", str(node.config), {})["fetches"]
    assert view["state"] == "failed" and "stopped before finishing" in view["error"]
