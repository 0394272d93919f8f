"""Small pure pieces of the agent, imported in-process."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest


def test_placeholders_are_replaced_in_one_pass(agent_module: ModuleType) -> None:
    values = {"port": "8000", "weights": "/models/{port}", "host": "10.0.0.1"}
    argv = agent_module.build_argv(("/usr/bin/vllm", "serve"), ("{weights}", "--port={port}", "{host}{host}"), values)
    assert argv == ["/usr/bin/vllm", "serve", "/models/{port}", "--port=8000", "10.0.0.110.0.0.1"]


def test_mount_point_is_the_longest_prefix_and_a_later_mount_on_top_wins(tmp_path: Path,
                                                                          agent_module: ModuleType) -> None:
    table = tmp_path / "mounts"
    table.write_text(
        "/dev/sda1 / ext4 rw 0 0\n"
        "/dev/sdb1 /data ext4 rw 0 0\n"
        "filer:/x /data ceph rw 0 0\n"
        "fs /data/with\\040space fuse.sshfs rw 0 0\n"
        "/dev/sdc1 /dat xfs rw 0 0\n"
    )
    mounts = agent_module.read_mounts(str(table))
    assert agent_module.mount_for("/data/cache", mounts) == ("/data", "ceph")
    assert agent_module.mount_for("/data/with space/m", mounts) == ("/data/with space", "fuse.sshfs")
    assert agent_module.mount_for("/database", mounts) == ("/", "ext4")
    assert agent_module.is_shared_fstype("fuse.sshfs") and not agent_module.is_shared_fstype("xfs")


def test_log_tail_reads_only_the_end_of_a_big_log(tmp_path: Path, agent_module: ModuleType) -> None:
    log = tmp_path / "engine.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert agent_module.tail_lines(str(log)) == [f"line {i}" for i in range(99_980, 100_000)]
    assert agent_module.tail_lines(str(tmp_path / "missing.log")) == []


@pytest.mark.parametrize(("url", "name"), [
    ("https://h/models/a.gguf", "a.gguf"), ("https://h/models/", "download"), ("https://h/x/..%2F..%2Fetc", "download"),
    ("https://h/llmgw-manifest.json", "download"), ("https://h/a%20b.bin", "a b.bin"),
])
def test_download_file_name_is_the_last_safe_path_segment(agent_module: ModuleType, url: str, name: str) -> None:
    assert agent_module._url_filename(url) == name


def test_nvidia_smi_lines_that_do_not_parse_are_skipped(agent_module: ModuleType) -> None:
    text = "0, NVIDIA H100 PCIe, GPU-1, 81559, 0, 0\nUnable to determine the device handle for GPU0001:00:00.0\n"
    [gpu] = agent_module.parse_nvidia_smi(text)
    assert (gpu["class"], gpu["healthy"], gpu["memory_used_gb"]) == ("h100", True, 0.0)
