"""nodes.yaml may name a node's agent config (two nodes on one host cannot both use
/etc/llmgw/agent.json): it reaches the dispatcher as the agent's ``--config``; a bad path is a
`file:line` error, never a silent default."""

from __future__ import annotations

from pathlib import Path

from llmgw.catalog import load_directory
from llmgw.catalog.loader import read_directory, validate_files
from llmgw.control.fleet_dispatch import target_of
from llmgw.dispatch.base import local_agent
from llmgw.dispatch.sshconn import SshConnection

NODES = """\
nodes:
  - id: gpu-a
    address: 10.0.0.11
    agent_config: /etc/llmgw/agent-gpu-a.json
  - id: gpu-b
    address: 10.0.0.11
    agent_config: {path}
  - id: plain
    address: 10.0.0.12
"""


def _catalog(tmp_path: Path, path: str) -> Path:
    (tmp_path / "models").mkdir()
    (tmp_path / "nodes.yaml").write_text(NODES.format(path=path))
    return tmp_path


def test_agent_config_reaches_the_agents_command_line(tmp_path: Path) -> None:
    catalog = load_directory(_catalog(tmp_path, "/etc/llmgw/agent-gpu-b.json"))
    targets = {n.id: target_of(n) for n in catalog.nodes}
    assert targets["gpu-a"].agent_config == "/etc/llmgw/agent-gpu-a.json"
    assert targets["plain"].agent_config is None  # the agent finds its own (/etc/llmgw/agent.json)
    command = SshConnection(targets["gpu-b"], local_agent()).command()
    assert command.endswith(" --config /etc/llmgw/agent-gpu-b.json serve"), command


def test_a_relative_or_odd_path_is_an_error_naming_the_line(tmp_path: Path) -> None:
    for bad in ("agent.json", "'/etc/llmgw/a b.json'", "'-/x'"):
        root = tmp_path / bad.strip("'").replace("/", "_").replace(" ", "_")
        root.mkdir()
        result = validate_files(read_directory(_catalog(root, bad)))
        assert result.catalog is None
        [problem] = result.problems
        assert (problem.file, problem.line) == ("nodes.yaml", 7), problem
        assert "agent_config" in problem.message and "absolute path" in problem.message, problem.message


def test_two_nodes_on_one_host_are_told_apart_by_agent_config_or_user(tmp_path: Path) -> None:
    two = "nodes:\n" + "".join(f"  - id: n{i}\n    address: 10.0.0.11\n{extra}" for i, extra in enumerate(
        ("    agent_config: /etc/llmgw/a.json\n", "    agent_config: /etc/llmgw/b.json\n", "    user: other\n", "")))
    (tmp_path / "models").mkdir()
    (tmp_path / "nodes.yaml").write_text(two)
    assert validate_files(read_directory(tmp_path)).ok
    # The same agent twice (same address, port, user and config) is still a mistake, named.
    (tmp_path / "nodes.yaml").write_text(two + "  - id: n9\n    address: 10.0.0.11\n")
    [problem] = validate_files(read_directory(tmp_path)).problems
    assert problem.line == 14 and 'node "n9" has the same address and port as node "n3"' in problem.message
    assert "their own agent_config, or their own user" in problem.message
