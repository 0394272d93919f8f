"""An engine that ends says why in its own words first; the agent's argv line (the sandbox's whole
command line, thousands of characters) is never what an operator reads."""

from __future__ import annotations

from llmgw.reconciler.lifecycle import exit_message

ARGV_LINE = "=== llmgw-agent 7: starting " + repr(["/usr/bin/bwrap", "--ro-bind", "/", "/"] + ["--tmpfs", "/x"] * 300)
MISSING_LIB = ("/root/.cache/llmgw/llama-server/0.3.36/bin/llama-server: error while loading shared libraries: "
               "libllama.so: cannot open shared object file: No such file or directory")


def test_a_missing_library_is_the_message_not_the_sandboxs_command_line() -> None:
    m = exit_message("local", 127, [ARGV_LINE, MISSING_LIB])
    assert m.startswith("engine on local exited with code 127 (the engine's executable or a library it needs "
                        "was not found (inside the sandbox: its directory must be in sandbox_paths)): ")
    assert m.endswith("libllama.so: cannot open shared object file: No such file or directory")
    assert "bwrap" not in m and len(m) < 500


def test_the_last_three_lines_of_the_engine_each_cut_and_silence_said() -> None:
    lines = [ARGV_LINE] + [f"line {i} " + "x" * 1000 for i in range(5)]
    m = exit_message("n1", 1, lines)
    assert "line 2" in m and "line 4" in m and "line 1 " not in m and len(m) < 1000
    assert exit_message("n1", 1, [ARGV_LINE]) == "engine on n1 exited with code 1: it wrote nothing to stderr"
