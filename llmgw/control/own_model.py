"""A person's own model for `llmgw up`: a GGUF file (or a split GGUF's parts) or a directory in
Hugging Face layout, turned into the catalog entry that serves it on this machine.

What it reads from the files: the format, the size, a name. What it decides: the engine (GGUF on
llama.cpp; safetensors on vLLM, else SGLang), a profile that fits this machine (one GPU where
``nvidia-smi`` answers, else the CPU), and where the node may read it from. The weights are served
where they lie (the node's ``model_dirs``: an operator's copy, never copied into the cache and
never deleted), since a model of tens of gigabytes on one machine should not be there twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmgw.errors import ConfigError

GIB = 1024**3
# A split GGUF's parts: <name>-00001-of-00003.gguf (llama.cpp's gguf-split); llama.cpp loads the
# first and finds the others beside it.
SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<parts>\d{5})\.gguf$", re.IGNORECASE)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# The engines each format runs on, in order of preference (the first one installed is taken).
ENGINES_FOR = {"gguf": ("llama.cpp",), "safetensors": ("vllm", "sglang")}
HOW_TO_GET = {
    "llama.cpp": "run scripts/build-llama-server (llama.cpp's server, built once into ~/.cache/llmgw), "
                 "or put llama-server on PATH",
    "vllm": "run scripts/build-vllm-cpu (vLLM for the CPU, built once into ~/.cache/llmgw), or put vllm on PATH",
}


@dataclass(frozen=True)
class OwnModel:
    """One model of a person's, as `up` serves it."""

    name: str
    path: Path  # what the engine loads: the .gguf file (a split one's first part), or the directory
    # What the node is allowed to read (its model_dirs entry): the file itself, or the model's
    # directory; never the folder a single file lies in (a GGUF in ~/Downloads must not let every
    # catalog entry name any file of ~/Downloads as its weights).
    folder: Path
    kind: str  # "gguf" | "safetensors"
    size_gb: float
    parts: int = 1

    @property
    def source(self) -> str:
        """A plain absolute path: the operator's own copy, used where it is (DESIGN §4)."""
        return str(self.folder if self.parts > 1 else self.path)


def describe(path: Path, *, name: str | None = None) -> OwnModel:
    """What ``path`` holds, or a ConfigError saying what it is not."""
    path = path.expanduser()
    if not path.exists():
        raise ConfigError(f"--model {path}: no such file or directory")
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"--model {path}: not a .gguf file (a model is a GGUF file, or a directory "
                              "with config.json and *.safetensors, as on Hugging Face)")
        return _gguf(path, name)
    if path.is_dir():
        return _directory(path, name)
    raise ConfigError(f"--model {path}: neither a file nor a directory")


def _gguf(path: Path, name: str | None) -> OwnModel:
    _check_gguf(path)
    m = SPLIT.match(path.name)
    if m is None:
        return OwnModel(_name(name, path.stem, path), path, path, "gguf", _gb(path.stat().st_size))
    parts = int(m.group("parts"))
    files = [path.parent / f"{m.group('stem')}-{i:05d}-of-{parts:05d}{path.suffix}" for i in range(1, parts + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"--model {path}: a split GGUF of {parts} parts, but {', '.join(missing[:3])} "
                          f"{'is' if len(missing) == 1 else 'are'} not beside it")
    first = files[0]
    return OwnModel(_name(name, m.group("stem"), path), first, path.parent, "gguf",
                    _gb(sum(f.stat().st_size for f in files)), parts)


def _check_gguf(path: Path) -> None:
    """A file that says .gguf but is not one would fail only in the engine, minutes later."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ConfigError(f"--model {path}: cannot read it: {exc.strerror or exc}") from exc
    if magic != b"GGUF":
        raise ConfigError(f"--model {path}: not a GGUF file (it does not begin with the GGUF magic bytes)")


def _directory(path: Path, name: str | None) -> OwnModel:
    ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    weights = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".safetensors")
    if weights and (path / "config.json").is_file():
        return OwnModel(_name(name, path.name, path), path, path, "safetensors",
                        _gb(sum(p.stat().st_size for p in path.iterdir() if p.is_file())))
    if ggufs:
        listed = ", ".join(p.name for p in ggufs[:3])
        raise ConfigError(f"--model {path}: a directory of GGUF files ({listed}); name the .gguf file to serve")
    missing = "config.json" if weights else "*.safetensors files"
    raise ConfigError(f"--model {path}: not a model directory: it has no {missing} (a Hugging Face layout: "
                      "config.json, tokenizer files and *.safetensors), and no .gguf file")


def _name(given: str | None, stem: str, path: Path) -> str:
    """The name clients ask for: the one given, else the file's, lower-cased, in the catalog's alphabet."""
    if given is not None:
        if not NAME_PATTERN.match(given):
            raise ConfigError(f"--name {given!r}: a model name is letters, digits, '.', '_', ':', '/' or '-', "
                              "starting with a letter or digit")
        return given
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._")[:128]
    if not name or not NAME_PATTERN.match(name):
        raise ConfigError(f"--model {path}: no model name can be made of {stem!r}; give one with --name")
    return name


def _gb(size: int) -> float:
    """Sizes in the catalog are GB with two decimals, never 0 (a size of 0 would fit any disk)."""
    return max(math.ceil(size / GIB * 100) / 100, 0.01)


def engine_for(model: OwnModel, installed: Mapping[str, object]) -> str:
    """The first engine of the model's format the node has, or a ConfigError saying how to get one."""
    for engine in ENGINES_FOR[model.kind]:
        if engine in installed:
            return engine
    wanted = ENGINES_FOR[model.kind][0]
    raise ConfigError(f"--model {model.path}: a {model.kind} model runs on {' or '.join(ENGINES_FOR[model.kind])}, "
                      f"and this machine has none: {HOW_TO_GET.get(wanted, f'install {wanted}')}")


def catalog_entry(model: OwnModel, engine: str, *, gpus: int, pool: str | None) -> dict:
    """The model's catalog file, as data: one replica, on this machine's GPU or its CPU."""
    args: list[str] = []
    if engine == "llama.cpp":
        # One parallel slot per request stream up to 4; a context big enough for a conversation.
        args = ["--ctx-size", "4096", "--parallel", "2"] + (["-ngl", "999"] if gpus else [])
        if model.parts > 1:
            args = ["-m", "{weights}/" + model.path.name, *args]
    elif engine == "vllm" and not gpus:
        # vLLM on the CPU (scripts/build-vllm-cpu): no CUDA graphs, a small batch.
        args = ["--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "4"]
    # RAM: the weights, the KV cache and the engine's own (llama.cpp maps the file; vLLM on CPU
    # holds its KV cache beside the weights).
    memory = math.ceil(model.size_gb * 1.3 + (1 if engine == "llama.cpp" else 4))
    profile: dict = {"name": "gpu" if gpus else "cpu", "engine": engine, "gpus": 1 if gpus else 0,
                     "memory_gb": memory}
    if pool:
        profile["pool"] = pool
    if args:
        profile["args"] = args
    return {"name": model.name, "task": "chat", "source": model.source, "size_gb": model.size_gb,
            "scaling": {"min": 1, "max": 1}, "profiles": [profile]}


def entry_yaml(model: OwnModel, entry: dict) -> str:
    head = (f"# Your own model, served by `llmgw up` from {model.path}\n"
            "# where it lies (the local node's model_dirs): never copied, never deleted. Edit and commit\n"
            "# like any catalog file.\n")
    return head + yaml.safe_dump(entry, sort_keys=False)
