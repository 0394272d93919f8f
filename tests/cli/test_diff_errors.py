"""`llmgw diff` that cannot run still writes a document of the format asked for: CI posts the markdown
as a pull request comment (never an empty one), scripts read the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from llmgw.plan.render import MARKDOWN_LIMIT, render_error_markdown


def test_an_error_is_a_markdown_comment_the_message_cannot_break_out_of() -> None:
    message = "models/x.yaml: ```` is not a name"
    text = render_error_markdown(message)
    assert text == f"### :x: llmgw diff could not run\n\n`````text\n{message}\n`````\n"
    huge = render_error_markdown("x" * (2 * MARKDOWN_LIMIT))
    assert len(huge) <= MARKDOWN_LIMIT and huge.endswith("\n…\n```\n")


def test_each_format_says_what_went_wrong(run_cli, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    code, out = run_cli("diff", "--repo", str(missing), "--format", "markdown")
    assert code == 1 and out.startswith("### :x: llmgw diff could not run\n\n```text\n") and str(missing) in out
    code, out = run_cli("diff", "--repo", str(missing), "--format", "json")
    assert code == 1 and str(missing) in json.loads(out)["error"]
    code, out = run_cli("diff", "--repo", str(missing))
    assert code == 1 and out.startswith("error: ") and str(missing) in out
