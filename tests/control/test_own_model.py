"""`llmgw up --model`: what a model's files are taken for, the errors that say what is wrong before
anything is written, and the node settings a person keeps across runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from llmgw.control.own_model import catalog_entry, describe, engine_for
from llmgw.control.up import UpLayout, prepare
from llmgw.errors import ConfigError


def gguf(path: Path, size: int = 1024) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + b"\0" * (size - 4))
    return path


def test_a_gguf_file_is_named_from_its_file_and_read_where_it_lies(tmp_path: Path) -> None:
    m = describe(gguf(tmp_path / "models" / "Qwen2.5-7B-Instruct-Q4_K_M.gguf", 3 * 1024**3 // 100))
    assert (m.name, m.kind, m.source, m.folder) == ("qwen2.5-7b-instruct-q4_k_m", "gguf",
                                                    str(tmp_path / "models" / "Qwen2.5-7B-Instruct-Q4_K_M.gguf"),
                                                    tmp_path / "models" / "Qwen2.5-7B-Instruct-Q4_K_M.gguf")
    assert m.size_gb == 0.03


def test_a_split_gguf_is_served_from_its_first_part_with_every_part_counted(tmp_path: Path) -> None:
    for i in (1, 2, 3):
        gguf(tmp_path / f"big-0000{i}-of-00003.gguf", 2048)
    m = describe(tmp_path / "big-00002-of-00003.gguf")
    assert (m.name, m.parts, m.path.name, m.source) == ("big", 3, "big-00001-of-00003.gguf", str(tmp_path))
    entry = catalog_entry(m, "llama.cpp", gpus=0, pool="local")
    assert entry["profiles"][0]["args"][:2] == ["-m", "{weights}/big-00001-of-00003.gguf"]
    (tmp_path / "big-00003-of-00003.gguf").unlink()
    with pytest.raises(ConfigError, match="big-00003-of-00003.gguf is not beside it"):
        describe(tmp_path / "big-00001-of-00003.gguf")


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: (p / "x.bin").write_bytes(b"GGUF"), "not a .gguf file"),
    (lambda p: (p / "x.gguf").write_bytes(b"PK\x03\x04zip"), "does not begin with the GGUF magic"),
    (lambda p: (p / "d").mkdir(), "no \\*.safetensors files"),
    (lambda p: ((p / "d").mkdir(), (p / "d" / "model.safetensors").write_bytes(b"x")), "no config.json"),
])
def test_what_is_not_a_model_is_said_with_its_path(tmp_path: Path, make, message: str) -> None:  # noqa: ANN001
    make(tmp_path)
    target = next(p for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match=message) as e:
        describe(target)
    assert str(target) in str(e.value)


def test_a_safetensors_directory_runs_on_vllm_and_a_missing_engine_says_how_to_get_one(tmp_path: Path) -> None:
    d = tmp_path / "SmolLM2"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 4096)
    m = describe(d, name="smol")
    assert (m.name, m.kind, m.source) == ("smol", "safetensors", str(d))
    assert engine_for(m, {"vllm": "/x/vllm", "sglang": "/y"}) == "vllm"
    assert engine_for(m, {"sglang": "/y"}) == "sglang"
    with pytest.raises(ConfigError, match="scripts/build-vllm-cpu"):
        engine_for(m, {"llama.cpp": "/z"})
    with pytest.raises(ConfigError, match="scripts/build-llama-server"):
        engine_for(describe(gguf(tmp_path / "a.gguf")), {"vllm": "/x"})


def _prepare(data: Path, **kw):  # noqa: ANN202
    return prepare(data, catalog=None, router_port=18080, admin_port=18081, **kw)


def test_up_with_a_model_it_cannot_serve_leaves_no_data_dir(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr("llmgw.control.up.found_engines", dict)
    data = tmp_path / "state"
    with pytest.raises(ConfigError, match="runs on llama.cpp, and this machine has none"):
        _prepare(data, model=gguf(tmp_path / "m.gguf"))
    assert not data.exists()
    with pytest.raises(ConfigError, match="no such file"):
        _prepare(data, model=tmp_path / "missing.gguf")
    assert not data.exists()


def test_the_model_is_committed_once_and_its_folder_readable_by_the_node(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    exe = tmp_path / "llama" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", str(exe))
    monkeypatch.setenv("LLMGW_VLLM_CACHE", str(tmp_path / "none"))
    data = tmp_path / "state"
    model = gguf(tmp_path / "weights" / "tiny.gguf")
    _prepare(data, model=model, name="tiny")
    layout = UpLayout(data)
    agent = json.loads(layout.agent_config.read_text())
    assert agent["engines"]["llama.cpp"] == str(exe) and str(tmp_path / "llama") in agent["sandbox_paths"]
    assert agent["model_dirs"] == [str(model)]  # the file, not the folder it lies in
    entry = yaml.safe_load((layout.catalog / "models" / "tiny.yaml").read_text())
    assert entry["source"] == str(model) and entry["profiles"][0]["engine"] == "llama.cpp"
    # The person's own settings: kept across runs, and they reach the agent config.
    assert "model_dirs:" in layout.node_settings.read_text()  # written once, every key explained
    layout.node_settings.write_text("model_dirs: [/srv/models]\nengine_env: {OMP_NUM_THREADS: '2'}\n")
    _prepare(data, model=model, name="tiny")  # the same again: nothing new to commit
    agent = json.loads(layout.agent_config.read_text())
    assert agent["model_dirs"] == [str(model), "/srv/models"]
    assert agent["engine_env"]["OMP_NUM_THREADS"] == "2"
    assert layout.node_settings.read_text().startswith("model_dirs: [/srv/models]")
    subjects = subprocess.run(["git", "log", "--format=%s"], cwd=layout.catalog, capture_output=True, text=True,
                              check=True).stdout.splitlines()
    assert subjects == ["Serve tiny (llmgw up --model)", "Initial catalog (llmgw up)"]
    # Another file under the same name is refused, naming both.
    with pytest.raises(ConfigError, match="already has a model named 'tiny'"):
        _prepare(data, model=gguf(tmp_path / "other" / "tiny.gguf"), name="tiny")


def test_a_settings_file_with_a_mistake_is_an_error_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "state"
    _prepare(data)
    layout = UpLayout(data)
    layout.node_settings.write_text("model_dirs: relative/path\n")
    with pytest.raises(ConfigError, match="settings.yaml: model_dirs: a list of absolute paths"):
        _prepare(data)
    layout.node_settings.write_text("engins: {}\n")
    with pytest.raises(ConfigError, match="unknown setting 'engins'"):
        _prepare(data)


def test_engines_are_let_read_the_model_and_never_the_folder_it_lies_in(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Seen in review: a GGUF in ~ made all of ~ (its .ssh, the data dir's store and token)
    readable by engines and nameable as weights by any catalog entry."""
    exe = tmp_path / "llama" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", str(exe))
    data = tmp_path / "state"
    model = gguf(tmp_path / "Downloads" / "tiny.gguf")
    (tmp_path / "Downloads" / "secret.txt").write_text("no")
    _prepare(data, model=model, name="tiny")
    assert json.loads(UpLayout(data).agent_config.read_text())["model_dirs"] == [str(model)]  # the file only
    # A model directory that holds the data dir (or is a home, or /) is refused, nothing written.
    other = tmp_path / "other-state"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setenv("LLMGW_VLLM", str(exe))
    with pytest.raises(ConfigError, match="engines would be let read all of"):
        _prepare(tmp_path / "nested" / "state", model=tmp_path, name="wide")
    assert not other.exists()
