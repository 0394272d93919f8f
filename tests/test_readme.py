"""The README's two set-up commands stay true: CI runs exactly the second one."""

from __future__ import annotations

import re

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
