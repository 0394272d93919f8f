"""Key and tenant names made through `llmgw keys create` / `llmgw up --key`: a name is checked whole
(a trailing newline made a tenant of its own, with no limits, and a key no command could revoke),
and routers take what a newer controller sends about keys."""

from __future__ import annotations

import subprocess

import pytest

from llmgw.control.keys import KeyBook, KeyRefused
from llmgw.errors import ConfigError
from llmgw.router.keys import KeyRing
from tests.e2e.processes import LLMGW


class Store:
    def __init__(self) -> None:
        self.keys: list[dict] = []

    def api_keys(self) -> list[dict]:
        return [dict(k) for k in self.keys]

    def add_api_key(self, entry: dict) -> bool:
        self.keys.append(entry)
        return True


@pytest.mark.parametrize(("name", "tenant"), [("k2\n", None), ("k2", "paid\n"), ("k 2", None), ("k2", "../x")])
def test_a_name_is_checked_whole(name: str, tenant: str | None) -> None:
    book = KeyBook([], Store(), on_change=lambda _: None)
    with pytest.raises(KeyRefused, match="letters, digits"):
        book.create(name, ["*"], tenant)
    assert book.listing() == []


def test_a_router_takes_fields_a_newer_controller_sends_but_a_file_may_not_have_them() -> None:
    entry = {"name": "a", "sha256": "0" * 64, "models": ["*"], "tenant": "t", "expires": 5}
    [key] = KeyRing.from_entries([entry], strict=False).keys
    assert (key.name, key.tenant) == ("a", "t")
    with pytest.raises(ConfigError, match="unknown key\\(s\\): expires"):
        KeyRing.from_entries([entry])


def test_up_refuses_a_key_name_it_could_not_make_before_it_starts(tmp_path) -> None:  # noqa: ANN001
    """Refused after the start, the router stayed open to anyone while the welcome said keys."""
    done = subprocess.run([LLMGW, "up", "--data-dir", str(tmp_path / "d"), "--key", "bad name"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "--key: 'bad name': letters, digits" in done.stdout + done.stderr
    assert not (tmp_path / "d").exists()
