"""Shared output helpers: every command prints through a Console it is given.

Passing the Console in (rather than a module-global one) is what lets tests render a
command into a StringIO and compare the text a person would see.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text


def make_console(*, stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_json(console: Console, data: Any) -> None:
    """JSON for machines: plain text, no markup, no wrapping, one document."""
    console.file.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    console.file.flush()


def fail(console: Console, message: str, *, code: int = 1) -> int:
    """``error: message`` on stderr (a console on the process's stdout is swapped for one on
    stderr: `llmgw nodes -o json > f` must not write the error into f); ``code``."""
    if console.file is sys.stdout:
        console = make_console(stderr=True)
    console.print(f"[bold red]error:[/] {_escape(message)}")
    return code


def _escape(text: str) -> str:
    from rich.markup import escape

    from llmgw.safetext import visible

    # A message quotes what it is about (a file name, a catalog key, a server's answer): shown as
    # text, never as rich markup nor as terminal escapes.
    return escape(visible(text))



class WordTable(Table):
    """A table whose cells wrap between words, never inside one; on a terminal too narrow for its
    longest words, one block per row instead (seen: below ~150 columns every table folded ids and
    names mid-word, "sim-cha" / "t-g1"). Rows are added as markup strings, as on a rich Table."""

    LONGEST = 48  # a word longer than this (a URL, an error's path) may still fold

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        words = [max((len(w) for r in self._rows_text(i) for w in r.split()), default=0) for i in
                 range(len(self.columns))]
        mins = [min(max(w, len(Text.from_markup(str(c.header)).plain)), self.LONGEST)
                for w, c in zip(words, self.columns, strict=True)]
        # Borders and padding: one rule per column and a space each side.
        if sum(mins) + 3 * len(mins) + 1 <= options.max_width:
            for col, width in zip(self.columns, mins, strict=True):
                col.min_width = width
            yield from super().__rich_console__(console, options)
            return
        yield from self._blocks()

    def _rows_text(self, index: int) -> list[str]:
        return [Text.from_markup(str(cell)).plain for cell in self.columns[index]._cells]

    def _blocks(self) -> RenderResult:
        if self.title:
            yield Text.from_markup(f"[bold]{self.title}[/]")
        headers = [Text.from_markup(str(c.header)).plain for c in self.columns]
        width = max((len(h) for h in headers), default=0)
        for row in zip(*(c._cells for c in self.columns), strict=True):
            first, *rest = row
            yield Text.from_markup(f"[bold]{first}[/]")
            for header, cell in zip(headers[1:], rest, strict=True):
                text = Text.from_markup(str(cell))
                if text.plain.strip() and text.plain != "-":
                    yield Text(f"  {header:<{width}}  ") + text
