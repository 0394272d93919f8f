"""Read a catalog from a directory or a git commit, and validate it in both layers.

The readers only gather bytes (I/O at the edge); `validate_files` is pure and is what
the CLI, the controller and `llmgw diff` all call, so they can never disagree about
whether a commit is valid.
"""

from __future__ import annotations

import errno
import gc
import multiprocessing as mp
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmgw.catalog.build import build_model, build_node, build_settings
from llmgw.catalog.model import Catalog, Model, Settings
from llmgw.catalog.problems import Problem
from llmgw.catalog.schema import check_schema
from llmgw.catalog.semantic import ModelEntry, NodeEntry, check_catalog, check_tenants
from llmgw.catalog.yamlpos import Document, parse_yaml
from llmgw.errors import CatalogError

# A model file is a few dozen lines; a file this large is a mistake (a weights file
# committed by hand, a generated dump) and parsing it would only hide that.
MAX_FILE_BYTES = 1024 * 1024
# The whole catalog is bounded too, from the sizes a tree listing gives, before any byte is read:
# fifty files each just under the limit above took a controller from 230 MB to 1.8 GB and held
# the next good commit 133 s while they were parsed. A model file is under a KiB, so these leave
# a fleet thousands of models; parsing the worst 4 MiB of YAML peaks at ~120 MB.
MAX_CATALOG_FILES = 2000
MAX_CATALOG_BYTES = 4 * 1024 * 1024
# Entries of any kind the models directory may list (a README beside each model file is fine);
# past this it is not listed further, so a tree of a million names costs nothing either.
MAX_MODELS_ENTRIES = 2 * MAX_CATALOG_FILES
MAX_PROBLEMS = 1000  # what one validation reports (a file's own are bounded in schema.py)
_MIB = 1024 * 1024

SETTINGS_FILE = "llmgw.yaml"
NODES_FILE = "nodes.yaml"
MODELS_DIR = "models"


@dataclass(frozen=True)
class RawFile:
    """A catalog file's bytes; ``size`` is the real size even when ``data`` was cut short.

    ``refused`` says why a reader would not read the entry (a symlink, a FIFO); ``data`` is
    then empty, so nothing downstream can print what the entry points at.
    """

    path: str
    data: bytes
    size: int
    refused: str | None = None


# A symlink in a pull request can point at any file on the CI runner or the controller
# (a token, a key); following it would print that file in the errors posted on the PR.
# Links that stay inside the repository are refused too: one rule is simpler to trust,
# and an in-repo link can be re-pointed outside by the next commit.
_MUST_BE_REGULAR = "catalog files must be regular files in the repository"
_SYMLINK = f"is a symbolic link; {_MUST_BE_REGULAR} (symlinks are not followed)"
MODELS_DIR_SYMLINK = (
    "is a symbolic link; the models directory must be a real directory in the repository "
    "(symlinks are not followed)"
)


MODELS_DIR_OVERFLOW = (
    f"lists more than {MAX_MODELS_ENTRIES:,} entries; a catalog may hold at most {MAX_CATALOG_FILES:,} files, "
    "so the directory was not listed further and no file was read"
)


def limit_problem(files: Mapping[str, RawFile]) -> Problem | None:
    """Why a catalog is too large to read, judged from its files' sizes alone (a reader knows
    them from a tree listing or a stat, before reading a byte); None when it is not.

    Both readers ask this before reading, and `validate_files` asks it first, so a catalog over
    a bound is one problem naming the bound and the figures, never a parse."""
    listed = files.get(MODELS_DIR)
    if listed is not None and listed.refused == MODELS_DIR_OVERFLOW:
        return Problem(MODELS_DIR, 1, 1, MODELS_DIR_OVERFLOW)
    catalog = [f for f in files.values() if is_catalog_file(f.path)]
    if len(catalog) > MAX_CATALOG_FILES:
        return Problem(MODELS_DIR, 1, 1, f"the catalog has {len(catalog):,} files; a catalog may hold at most "
                                         f"{MAX_CATALOG_FILES:,} files, so none was read")
    total = sum(f.size for f in catalog)
    if total > MAX_CATALOG_BYTES:
        largest = max(catalog, key=lambda f: (f.size, f.path))
        return Problem(largest.path, 1, 1, (
            f"the catalog's {len(catalog):,} files total {total / _MIB:.1f} MiB; a catalog may hold at most "
            f"{MAX_CATALOG_BYTES // _MIB} MiB in all, so none was read (the largest is this one, "
            f"{largest.size / _MIB:.1f} MiB)"))
    return None


def refusal(mode: int) -> str | None:
    """Why an entry of this mode (``st_mode``, or a git tree entry's mode) is not read; None if regular."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return _SYMLINK
    if stat.S_ISFIFO(mode):
        return f"is a named pipe (FIFO); {_MUST_BE_REGULAR}"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return f"is a device file; {_MUST_BE_REGULAR}"
    if stat.S_ISSOCK(mode):
        return f"is a socket; {_MUST_BE_REGULAR}"
    return f"is not a regular file; {_MUST_BE_REGULAR}"


@dataclass(frozen=True)
class ValidationResult:
    catalog: Catalog | None
    problems: tuple[Problem, ...]
    files: int

    @property
    def ok(self) -> bool:
        return self.catalog is not None and not self.problems


def is_catalog_file(rel: str) -> bool:
    """The files a catalog is made of, as paths relative to the catalog root."""
    if rel in (SETTINGS_FILE, NODES_FILE, "llmgw.yml", "nodes.yml"):
        return True
    parts = rel.split("/")
    return len(parts) == 2 and parts[0] == MODELS_DIR and parts[1].endswith((".yaml", ".yml"))


def read_directory(root: str | Path) -> dict[str, RawFile]:
    """The catalog files under ``root``, read at most MAX_FILE_BYTES + 1 each, and none at all
    (sizes only) when the catalog is over a bound (`limit_problem`).

    ``root`` itself is trusted (the caller named it). Below it nothing is followed: a symlinked
    file or ``models`` directory, a FIFO or a device comes back refused, never opened, so no
    file whose real path is outside ``root`` is read. Entries are opened relative to the
    directory already opened, with O_NOFOLLOW, so a link swapped in after the check is refused
    too; O_NONBLOCK keeps a FIFO swapped in from hanging the open.
    """
    root = Path(root)
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise CatalogError(f"{root}: not a directory") from exc
    out: dict[str, RawFile] = {}
    models_fd: int | None = None
    try:
        found = [(root_fd, name, name) for name in (SETTINGS_FILE, "llmgw.yml", NODES_FILE, "nodes.yml")]
        models_fd = _open_models_dir(root_fd, out)
        if models_fd is not None:
            found += [(models_fd, name, f"{MODELS_DIR}/{name}") for name in _model_names(models_fd, out)]
        sizes = {rel: (dir_fd, name, size) for dir_fd, name, rel in found
                 if (size := _look(dir_fd, name, rel, out)) is not None}
        listed = {**out, **{rel: RawFile(rel, b"", size) for rel, (_, _, size) in sizes.items()}}
        if limit_problem(listed) is not None:
            return listed
        for rel, (dir_fd, name, _) in sizes.items():
            _read_entry(dir_fd, name, rel, out)
    finally:
        if models_fd is not None:
            os.close(models_fd)
        os.close(root_fd)
    return out


_NO_FOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _model_names(models_fd: int, out: dict[str, RawFile]) -> list[str]:
    """The YAML names in the models directory, listed no further than MAX_MODELS_ENTRIES."""
    names = []
    with os.scandir(models_fd) as listing:
        for count, entry in enumerate(listing, start=1):
            if count > MAX_MODELS_ENTRIES:
                out[MODELS_DIR] = RawFile(MODELS_DIR, b"", 0, refused=MODELS_DIR_OVERFLOW)
                return []
            if Path(entry.name).suffix in (".yaml", ".yml"):
                names.append(entry.name)
    return sorted(names)


def _open_models_dir(root_fd: int, out: dict[str, RawFile]) -> int | None:
    try:
        mode = os.stat(MODELS_DIR, dir_fd=root_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        out[MODELS_DIR] = RawFile(MODELS_DIR, b"", 0, refused=MODELS_DIR_SYMLINK)
        return None
    if not stat.S_ISDIR(mode):
        return None  # a file named `models` holds no model files, as in a git tree
    try:
        return os.open(MODELS_DIR, _NO_FOLLOW | os.O_DIRECTORY, dir_fd=root_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        out[MODELS_DIR] = RawFile(MODELS_DIR, b"", 0, refused=MODELS_DIR_SYMLINK)
        return None


def _look(dir_fd: int, name: str, rel: str, out: dict[str, RawFile]) -> int | None:
    """The size of the regular file `name`, or None (absent, a directory, or refused into out)."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(info.st_mode):
        return None  # a directory named like a catalog file is not one, as in a git tree
    # A device is refused on its mode alone: opening one can have effects (a tape rewinds).
    if reason := refusal(info.st_mode):
        out[rel] = RawFile(rel, b"", 0, refused=reason)
        return None
    return info.st_size


def _read_entry(dir_fd: int, name: str, rel: str, out: dict[str, RawFile]) -> None:
    try:
        fd = os.open(name, _NO_FOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        # ELOOP: replaced by a symlink since the stat. Otherwise (permissions) say why, not what.
        why = _SYMLINK if exc.errno == errno.ELOOP else f"cannot be read: {exc.strerror}"
        out[rel] = RawFile(rel, b"", 0, refused=why)
        return
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if reason := refusal(st.st_mode):  # replaced by a FIFO, a device or a directory since the stat
            out[rel] = RawFile(rel, b"", 0, refused=reason)
            return
        out[rel] = RawFile(rel, fh.read(MAX_FILE_BYTES + 1), st.st_size)


def _decode(raw: RawFile) -> tuple[str | None, Problem | None]:
    if raw.refused:
        return None, Problem(raw.path, 1, 1, raw.refused)
    if raw.size > MAX_FILE_BYTES:
        mb = raw.size / (1024 * 1024)
        return None, Problem(raw.path, 1, 1, f"file is {mb:.1f} MiB; a catalog file may be at most 1 MiB")
    try:
        text = raw.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.data[: exc.start].count(b"\n") + 1
        return None, Problem(
            raw.path, line, 1, f"not UTF-8 text: byte 0x{raw.data[exc.start]:02x} at offset {exc.start}"
        )
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip() or all(
        not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()
    ):
        return None, Problem(raw.path, 1, 1, "file is empty; expected a mapping")
    return text, None


# Control characters but a line break and a tab (a prompt, a template may hold those), DEL, C1 and
# the bidirectional overrides: a catalog string is echoed in events, status, logs and the terminals
# reading them (seen: an ESC sequence in engine args, echoed back in the engine's error).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def control_problems(doc: Document) -> list[Problem]:
    """Each key or string of ``doc`` holding a control character, at its ``file:line``. A loop, not
    a nested recursive function: that one's closure, a reference cycle, kept each file's parsed
    document alive while the cyclic collector is paused (validate_files), 45 MiB a large file."""
    out: list[Problem] = []
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc.data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if m := _CONTROL.search(value):
                # The string is quoted (cut): every renderer shows its control characters as escapes.
                shown = value if len(value) <= 120 else value[:120] + "…"
                out.append(doc.problem(path, f"control character U+{ord(m.group()):04X} in \"{shown}\": not "
                                             "allowed in a catalog (it would reach terminals and logs)"))
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))
    return sorted(out)


def _parse(raw: RawFile, kind: str, problems: list[Problem]) -> Document | None:
    """Decode, parse, and schema-check one file; None unless it is fit for the next layer."""
    text, problem = _decode(raw)
    if problem:
        problems.append(problem)
        return None
    assert text is not None
    doc, found = parse_yaml(raw.path, text)
    problems.extend(found)
    if doc is None:
        return None
    if not isinstance(doc.data, dict):
        kind_name = "a list" if isinstance(doc.data, list) else "a single value"
        problems.append(Problem(raw.path, 1, 1, f"expected a mapping at the top level, found {kind_name}"))
        return None
    schema_problems = check_schema(kind, doc) + control_problems(doc)
    problems.extend(schema_problems)
    return None if schema_problems or found else doc


def validate_files(
    files: Mapping[str, RawFile], *, revision: str | None = None, workers: int = 1
) -> ValidationResult:
    """Validate a whole catalog; every problem at once, the Catalog only when there are none."""
    # Parsing and checking allocate millions of small objects and free them acyclically; the
    # cyclic collector only runs over them again and again (12% of a 1,000-model validation).
    # It is paused, not disabled for good: the previous state comes back, and any cycle made
    # here is collected on the next pass after.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _validate_files(files, revision=revision, workers=workers)
    finally:
        if was_enabled:
            gc.enable()


def _validate_files(files: Mapping[str, RawFile], *, revision: str | None, workers: int) -> ValidationResult:
    if (too_large := limit_problem(files)) is not None:
        return ValidationResult(None, (too_large,), len(files))
    problems: list[Problem] = []
    names = set(files)

    settings_name = next((n for n in (SETTINGS_FILE, "llmgw.yml") if n in names), None)
    settings_doc = _parse(files[settings_name], "settings", problems) if settings_name else None
    settings = build_settings(settings_doc, problems) if settings_doc else Settings()

    nodes_name = next((n for n in (NODES_FILE, "nodes.yml") if n in names), None)
    node_entries: list[NodeEntry] = []
    if nodes_name is None:
        problems.append(Problem(NODES_FILE, 1, 1, "nodes.yaml is missing; a catalog must declare its nodes"))
    else:
        nodes_doc = _parse(files[nodes_name], "nodes", problems)
        if nodes_doc is not None:
            node_entries = [
                NodeEntry(build_node(raw), nodes_doc, i) for i, raw in enumerate(nodes_doc.data["nodes"])
            ]

    entries: list[ModelEntry] = []
    unusable_names: set[str] = set()
    model_files = sorted(n for n in names if n.startswith(MODELS_DIR + "/"))
    for name, doc, found in _parse_models([files[n] for n in model_files], workers):
        problems.extend(found)
        if doc is None:
            unusable_names.update(_names_in_broken_file(files[name]))
            continue
        entries.append(ModelEntry(build_model(doc, settings, problems), doc))
    # Refused entries that are no file of their own kind (a symlinked `models` directory).
    handled = {settings_name, nodes_name, *model_files}
    problems += [Problem(n, 1, 1, f.refused) for n, f in files.items() if f.refused and n not in handled]

    problems += check_catalog(entries, node_entries, settings, other_model_names=unusable_names)
    problems += check_tenants(settings_doc, settings, {e.model.name for e in entries} | unusable_names)
    problems = sorted(set(problems))
    if len(problems) > MAX_PROBLEMS:  # a rejection is stored and served whole: bounded like the files
        rest = len(problems) - MAX_PROBLEMS
        problems = problems[:MAX_PROBLEMS] + [Problem(problems[MAX_PROBLEMS].file, 1, 1, (
            f"and {rest:,} more problems from here on, not shown (at most {MAX_PROBLEMS:,} are)"))]
    if problems:
        return ValidationResult(None, tuple(_short(p) for p in problems), len(files))
    models: tuple[Model, ...] = tuple(e.model for e in entries)
    catalog = Catalog(
        models=models, nodes=tuple(n.node for n in node_entries), settings=settings, revision=revision
    )
    return ValidationResult(catalog, (), len(files))


# A message quotes values clipped (schema.MAX_QUOTED); this bounds any that a rule quotes whole, so
# a rejection (stored, served on every poll) is at most MAX_PROBLEMS of these.
MAX_MESSAGE = 1000


def _short(problem: Problem) -> Problem:
    if len(problem.message) <= MAX_MESSAGE:
        return problem
    return replace(problem, message=problem.message[:MAX_MESSAGE] + "... (message cut short)")


# Below this many model files a second process costs more than it saves.
PARALLEL_FROM = 200


def _parse_one(raw: RawFile) -> tuple[str, Document | None, list[Problem]]:
    found: list[Problem] = []
    return raw.path, _parse(raw, "model", found), found


def _parse_models(raws: list[RawFile], workers: int) -> list[tuple[str, Document | None, list[Problem]]]:
    """Parse and schema-check model files, in ``workers`` forked processes for a big catalog.

    The per-file work is independent and pure, so it splits cleanly; only a single-threaded
    caller (the CLI) may ask for workers, since forking a process that runs threads is unsafe.
    """
    if workers <= 1 or len(raws) < PARALLEL_FROM or "fork" not in mp.get_all_start_methods():
        return [_parse_one(r) for r in raws]
    size = -(-len(raws) // workers)
    chunks = [raws[i:i + size] for i in range(0, len(raws), size)]
    with mp.get_context("fork").Pool(len(chunks)) as pool:
        pending = pool.map_async(_parse_chunk, chunks[1:])
        first = _parse_chunk(chunks[0])  # this process takes a share meanwhile
        parts = pending.get(timeout=600)
    return [x for part in [first, *parts] for x in part]


def _parse_chunk(raws: list[RawFile]) -> list[tuple[str, Document | None, list[Problem]]]:
    return [_parse_one(r) for r in raws]


def validate_best_effort(files: Mapping[str, RawFile], *, revision: str | None = None) -> ValidationResult:
    """Every problem, and beside them the catalog made of the model files that have none.

    For `llmgw diff`: a pull request with one broken model must still show the plan for
    the rest. Dropping a broken model can break another (a fallback to it), so files are
    dropped until what is left validates. No catalog when llmgw.yaml or nodes.yaml is broken.
    """
    first = validate_files(files, revision=revision)
    if first.catalog is not None:
        return first
    kept = dict(files)
    result = first
    for _ in range(len(files) + 1):
        bad = {p.file for p in result.problems}
        if bad & {SETTINGS_FILE, NODES_FILE, "llmgw.yml", "nodes.yml"}:
            return ValidationResult(None, first.problems, first.files)
        drop = {f for f in bad if f in kept}
        if not drop:
            break
        for f in drop:
            del kept[f]
        result = validate_files(kept, revision=revision)
        if result.catalog is not None:
            return ValidationResult(result.catalog, first.problems, first.files)
    return ValidationResult(None, first.problems, first.files)


def _names_in_broken_file(raw: RawFile) -> set[str]:
    """Best-effort names of a model file that failed validation.

    A fallback pointing at a model whose file is broken is not a second mistake; the
    file's stem counts too, since model files are named after their model and a file
    that does not even parse has no readable name.
    """
    out = {raw.path.rsplit("/", 1)[-1].rsplit(".", 1)[0]}
    if raw.refused or raw.size > MAX_FILE_BYTES:
        return out
    doc, _ = parse_yaml(raw.path, raw.data.decode("utf-8", errors="replace"))
    if doc is None or not isinstance(doc.data, dict):
        return out
    if isinstance(doc.data.get("name"), str):
        out.add(doc.data["name"])
    aliases = doc.data.get("aliases")
    if isinstance(aliases, list):
        out.update(a for a in aliases if isinstance(a, str))
    return out


def load_directory(root: str | Path) -> Catalog:
    """The valid catalog under ``root``; CatalogError carrying every problem otherwise."""
    result = validate_files(read_directory(root))
    if result.catalog is None:
        raise CatalogError(f"{root}: catalog has {len(result.problems)} problem(s)", result.problems)
    return result.catalog
