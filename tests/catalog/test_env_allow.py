"""Profile env names: the agents' default allow-list, widened only by what llmgw.yaml declares."""

from __future__ import annotations

from pathlib import Path

from llmgw.agent.llmgw_agent import DEFAULT_ENV_ALLOW
from llmgw.catalog import read_directory, validate_files
from tests.catalog.corpus import BIG, SETTINGS, write_catalog


def test_a_default_name_validates(tmp_path: Path) -> None:
    assert "OMP_NUM_THREADS" in DEFAULT_ENV_ALLOW
    result = validate_files(read_directory(write_catalog(tmp_path, {
        "models/big.yaml": BIG + "    env: {OMP_NUM_THREADS: '8'}\n"})))
    assert result.catalog is not None, result.problems
    big = next(m for m in result.catalog.models if m.name == "big")
    assert dict(big.profiles[0].env) == {"OMP_NUM_THREADS": "8"}


def test_a_name_the_fleet_declares_validates_and_only_that_one(tmp_path: Path) -> None:
    files = {"llmgw.yaml": SETTINGS + "env_allow: [VLLM_SLEEP_WHEN_IDLE]\n",
             "models/big.yaml": BIG + "    env: {VLLM_SLEEP_WHEN_IDLE: '1', BROWSER: 'sh -c id'}\n"}
    result = validate_files(read_directory(write_catalog(tmp_path, files)))
    assert result.catalog is None
    assert [p.message.split(":")[0] for p in result.problems] == [
        'env "BROWSER" is not on the agents\' default allow-list']


def test_env_allow_entries_must_be_variable_names(tmp_path: Path) -> None:
    files = {"llmgw.yaml": SETTINGS + "env_allow: ['LD_*']\n"}
    result = validate_files(read_directory(write_catalog(tmp_path, files)))
    assert result.catalog is None
    [problem] = result.problems
    assert problem.file == "llmgw.yaml" and "env_allow" in problem.message, problem
