"""The README's two set-up commands stay true: CI runs exactly the second one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


def _commands() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(.+?)\n```", text)


def test_readme_starts_with_two_setup_commands() -> None:
    commands = _commands()
    assert len(commands) >= 2
    install, tests = commands[0], commands[1]
    assert "pip install" in install and "llmgw up" in install.split("&&")[-1]
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert _commands()[1] in ci.splitlines()


def test_catalog_reference_in_the_readme_is_generated_from_the_schemas() -> None:
    from llmgw.catalog.reference import splice

    readme = (REPO_ROOT / "README.md").read_text()
    assert splice(readme) == readme, "run: python -m llmgw.catalog.reference --write README.md"


def test_readme_first_command_runs_llmgw_up() -> None:
    assert _commands()[0].endswith("llmgw up")


def _tour() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("## A five-minute tour")
    return text[start:text.index("\n## ", start + 1)]


def _venv() -> str:
    found = re.search(r"python3 -m venv (\S+)", _commands()[0])
    assert found, "the set-up command makes a venv"
    return found.group(1)


def test_the_tour_puts_llmgw_on_path_before_its_first_bare_llmgw() -> None:
    """The set-up installs into a venv, not onto PATH: a bare `llmgw` in the tour failed."""
    activate = {f"source {_venv()}/bin/activate", f". {_venv()}/bin/activate"}
    lines = [line.strip() for block in re.findall(r"```sh\n(.+?)\n```", _tour(), re.S) for line in block.splitlines()]
    first_llmgw = next(i for i, line in enumerate(lines) if re.match(r"(.*&&\s*)?llmgw\b", line))
    assert any(line in activate for line in lines[:first_llmgw]), lines[:first_llmgw + 1]
    # One way throughout: not the venv's path in one place and a bare name in another.
    assert f"{_venv()}/bin/llmgw" not in _tour()


def test_activating_the_venv_puts_llmgw_on_path_from_any_directory(tmp_path: Path) -> None:
    """What the tour's activation line does, with the venv running these tests (the set-up's own
    `.venv` when run as the README says); the tour goes on in the catalog repository, elsewhere."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").exists():
        pytest.skip(f"the tests run outside a venv ({venv}): nothing to activate")
    found = subprocess.run(
        ["bash", "-c", f'source "{venv}/bin/activate" && cd "{tmp_path}" && command -v llmgw'],
        capture_output=True, text=True, timeout=30, check=False,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == venv / "bin" / "llmgw"


def test_the_two_controllers_config_in_the_readme_is_one_llmgw_loads(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from llmgw.control.config import load_config

    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("### Running two controllers"):]
    block = section[section.index("```yaml\n") + len("```yaml\n"):section.index("```\n", section.index("```yaml"))]
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "from-the-environment")  # the file it names is on the machine
    monkeypatch.delenv("LLMGW_STORE", raising=False)
    (tmp_path / "controller.yaml").write_text(block)
    cfg = load_config(tmp_path / "controller.yaml")
    assert cfg.controller.store is not None and cfg.controller.store.startswith("postgresql://")
    lead = cfg.controller.leadership
    assert (lead.ttl, lead.renew, lead.retry, lead.margin) == (4.0, 1.0, 0.5, 1.0)  # "the defaults", as it says
    assert "tests/e2e/test_ha_failover.py" in section  # the walkthrough it describes, run by CI
