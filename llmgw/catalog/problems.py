"""A problem found in a catalog, located at ``file:line:col``.

Every layer of validation (YAML, JSON Schema, semantic rules) reports the same shape, so
the CLI, the controller's rejection record and `llmgw diff` print one format.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Problem:
    file: str
    line: int
    col: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.message}"

    def to_json(self) -> dict[str, object]:
        return {"file": self.file, "line": self.line, "col": self.col, "message": self.message}
