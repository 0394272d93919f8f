"""One way to name a controller in every command, and hints that name flags the command has.

The report: `diff --controller/--token`, `router --controller/--admin-token`, the rest
`--url/--token`, and error hints naming flags the command printing them did not have. Here every
command is found by walking the real parser, every hint is produced by running the real command
in the situation that prints it, and every flag a hint names is looked up in that command's
parser (or, for a quoted `llmgw CMD --flag`, in CMD's).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rich.console import Console

from llmgw.cli.main import build_parser, main
from tests.cli.conftest import up_dir
from tests.conftest import EXAMPLES, REPO_ROOT, git

Path_ = tuple[str, ...]

# Commands that name no controller: they run one, or read files.
LOCAL_COMMANDS = {("validate",), ("controller",), ("node", "trust"), ("up",)}
# login/logout name one controller by --url alone: the token they keep comes on stdin, never from
# the other sources (tests/admin/test_roles.py has them).
URL_ONLY_COMMANDS = {("login",), ("logout",)}
OLD_SPELLINGS = {("diff",): {"--controller": "url"},
                 ("router",): {"--controller": "url", "--admin-token": "token"}}


def commands(parser: argparse.ArgumentParser | None = None,
             path: Path_ = ()) -> Iterator[tuple[Path_, argparse.ArgumentParser]]:
    """Every parser of the `llmgw` tree that runs something (has a ``func``), with its words."""
    parser = parser or build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if path and parser.get_default("func") is not None and not any(a.required for a in subs):
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from commands(sub, (*path, name))


COMMANDS = dict(commands())


def options(path: Path_) -> dict[str, str]:
    """Option string → dest, for one command."""
    return {s: a.dest for a in COMMANDS[path]._actions for s in a.option_strings}


def argv_for(path: Path_, *extra: str) -> list[str]:
    """The command with a placeholder for each positional it requires."""
    positionals = [a for a in COMMANDS[path]._actions
                   if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
                   and a.nargs not in ("?", "*")]
    return [*path, *["x"] * len(positionals), *extra]


CONTROLLER_COMMANDS = sorted(p for p in COMMANDS if p not in LOCAL_COMMANDS | URL_ONLY_COMMANDS)


def test_every_command_that_talks_to_a_controller_takes_url_token_and_data_dir() -> None:
    assert set(LOCAL_COMMANDS) < set(COMMANDS)
    for path in COMMANDS:
        opts = options(path)
        if path in LOCAL_COMMANDS:
            assert "--url" not in opts, path
            continue
        if path in URL_ONLY_COMMANDS:
            assert "--url" in opts and "--token" not in opts and "--data-dir" not in opts, path
            continue
        assert {k: opts.get(k) for k in ("--url", "--token", "--data-dir")} == \
            {"--url": "url", "--token": "token", "--data-dir": "data_dir"}, path
    # The old spellings are the same options, not look-alikes with a rule of their own.
    for path, aliases in OLD_SPELLINGS.items():
        assert {k: options(path).get(k) for k in aliases} == aliases
    others = {s for p in CONTROLLER_COMMANDS if p not in OLD_SPELLINGS for s in options(p)}
    assert not others & {"--controller", "--admin-token"}


@pytest.mark.parametrize("path", CONTROLLER_COMMANDS, ids=" ".join)
def test_each_command_parses_url_and_token_and_its_old_spelling(path: Path_) -> None:
    parser = build_parser()
    args = parser.parse_args(argv_for(path, "--url", "http://ctl:8081", "--token", "t", "--data-dir", "d"))
    assert (args.url, args.token, args.data_dir) == ("http://ctl:8081", "t", "d")
    for alias, dest in OLD_SPELLINGS.get(path, {}).items():
        args = parser.parse_args(argv_for(path, alias, "http://old:8081" if dest == "url" else "old-token"))
        assert getattr(args, dest) == ("http://old:8081" if dest == "url" else "old-token")


# --- hints ------------------------------------------------------------------------------------
QUOTED = re.compile(r"`(?:\S*/)?llmgw ([a-z][^`]*)`")  # a command, not a pip spec (`llmgw @ git+…`)
FLAG = re.compile(r"(?<![\w$/-])(--?[a-zA-Z][\w-]*)")


def unknown_flags(text: str, path: Path_) -> list[str]:
    """Flags ``text`` names that the command they are about does not have.

    A quoted `llmgw CMD ... --flag` is checked against CMD; any other --flag against ``path``.
    """
    bad = []
    for quoted in QUOTED.findall(text):
        words = quoted.split()
        cmd = max((p for p in COMMANDS if tuple(words[: len(p)]) == p), key=len, default=None)
        if cmd is None:
            bad.append(f"`llmgw {quoted}`: no such command")
            continue
        bad += [f"`llmgw {quoted}`: {f}" for f in FLAG.findall(" ".join(words[len(cmd):]))
                if f.split("=")[0] not in options(cmd)]
    rest = QUOTED.sub("", text)
    bad += [f for f in FLAG.findall(rest) if f not in options(path)]
    return bad


def test_the_hint_checker_catches_a_flag_the_command_lacks() -> None:
    assert unknown_flags("pass --url and --token, or run `llmgw up --data-dir D`", ("status",)) == []
    assert unknown_flags("pass --controller URL", ("status",)) == ["--controller"]
    assert unknown_flags("confirm with `llmgw sync --allow-prune`", ("nodes",)) == []
    assert unknown_flags("see `llmgw nodes --allow-prune`", ("nodes",)) == \
        ["`llmgw nodes --allow-prune`: --allow-prune"]
    assert unknown_flags("(default: $LLMGW_ADMIN_URL, file:///x--y)", ("status",)) == []


@pytest.fixture
def run_any(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str]]:
    """Run `llmgw ARGS` in-process; what the console and stderr got (the router prints to stderr)."""

    def run(*args: str) -> tuple[int, str]:
        buf = io.StringIO()
        code = main(list(args), console=Console(file=buf, width=300, color_system=None, highlight=False,
                                                soft_wrap=True))
        return code, buf.getvalue() + capsys.readouterr().err

    return run


@pytest.fixture
def catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A catalog repository as the working directory, so `llmgw diff` gets as far as naming its fleet."""
    repo = tmp_path / "catalog"
    shutil.copytree(EXAMPLES, repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Catalog")
    monkeypatch.chdir(repo)
    return repo


def situations(tmp: Path, url: str) -> list[tuple[str, dict[str, str], list[str], str]]:
    """(name, environment, flags, what the message must say): each way of naming no single controller."""
    empty, half, full = tmp / "empty", tmp / "half", tmp / "full"
    empty.mkdir(parents=True)
    up_dir(half, None, "half-token")
    up_dir(full, "http://127.0.0.1:7", "full-token")  # an `up` at another address than ``url``
    return [
        ("nothing", {}, [], "no admin URL and token: pass --url and --token"),
        ("token alone", {}, ["--token", "t"], "--token needs --url"),
        ("url alone", {}, ["--url", url], f"--url {url} was given without a token: pass its token with --token"),
        ("token and data dir", {}, ["--token", "t", "--data-dir", str(empty)], "--token and --data-dir both"),
        ("empty data dir", {}, ["--data-dir", str(empty)], "no admin.token there"),
        ("data dir without url", {}, ["--data-dir", str(half)], "has an admin token but no admin.url"),
        ("env url alone", {"LLMGW_ADMIN_URL": url}, [], "LLMGW_ADMIN_URL is set but LLMGW_ADMIN_TOKEN is not"),
        ("env token alone", {"LLMGW_ADMIN_TOKEN": "t"}, [], "LLMGW_ADMIN_TOKEN is set but LLMGW_ADMIN_URL is not"),
        ("url not the data dir's", {}, ["--data-dir", str(full), "--url", url], "was given without a token"),
        ("not http", {}, ["--url", "file:///etc/passwd", "--token", "t"], "is not an http:// or https://"),
        ("credentials in url", {}, ["--url", "http://u:p@127.0.0.1:9", "--token", "t"], "no credentials"),
    ]


@pytest.mark.parametrize("path", CONTROLLER_COMMANDS, ids=" ".join)
@pytest.mark.usefixtures("catalog")
def test_every_hint_names_flags_the_command_has(path: Path_, run_any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A router that resolved a controller would serve: --listen it cannot parse makes sure it stops.
    guard = ["--listen", "no-port"] if path == ("router",) else []
    for name, env, flags, says in situations(tmp_path / "dirs", "http://127.0.0.1:9"):
        if path == ("diff",) and name == "nothing":
            continue  # diff names no controller then: it plans without a fleet, as documented
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            code, out = run_any(*argv_for(path, *flags, *guard))
        assert code in (1, 2), (name, out)
        assert says in out, (name, out)
        assert unknown_flags(out, path) == [], (name, out)
    if path == ("diff",):
        code, out = run_any("diff", "--snapshot", "fleet.json", "--url", "http://127.0.0.1:9")
        assert code == 1 and "--snapshot and a controller (--url, --token, --data-dir) both" in out
        assert unknown_flags(out, path) == []


def python_strings(source: str) -> Iterator[str]:
    """The string literals of a module as Python reads them (a literal split over lines is one)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def source_strings() -> Iterator[tuple[str, str]]:
    """Every quoted `llmgw ...` in the package's strings and docstrings and in the README: (where, text)."""
    for f in sorted((REPO_ROOT / "llmgw").rglob("*.py")):
        for text in python_strings(f.read_text()):
            for m in QUOTED.finditer(text):
                yield f"{f.relative_to(REPO_ROOT)}", m.group(0)
    readme = (REPO_ROOT / "README.md").read_text()
    for m in QUOTED.finditer(readme):
        yield "README.md", m.group(0)


def test_every_quoted_command_in_the_code_and_readme_exists_with_its_flags() -> None:
    found = list(source_strings())
    assert sum(where == "README.md" for where, _ in found) > 20  # the scan reads what it should
    assert ("README.md", "`llmgw router --limits-redis URL`") in found
    bad = [(where, text, unknown_flags(text, ())) for where, text in found]
    assert [b for b in bad if b[2]] == []


def test_diff_without_a_fleet_names_its_own_flags(run_any, catalog: Path) -> None:
    (catalog / "models" / "extra.yaml").write_text((catalog / "models").joinpath(
        sorted(p.name for p in (catalog / "models").glob("*.yaml"))[0]).read_text().replace("name: ", "name: x-", 1))
    for fmt in ("text", "markdown"):
        code, out = run_any("diff", "--format", fmt)
        assert code in (1, 2), out
        assert "--url URL" in out and "--snapshot FILE" in out, out
        assert unknown_flags(out.replace("`--", "--"), ("diff",)) == [], out


def test_models_add_of_a_missing_file_is_an_error_not_a_traceback(run_cli, admin_server, tmp_path: Path) -> None:
    s = admin_server("t")
    code, out = run_cli("models", "add", str(tmp_path / "missing.yaml"), "--url", s.url, "--token", "t")
    assert code == 1
    assert out.strip() == f"error: {tmp_path / 'missing.yaml'}: cannot read it: No such file or directory"
