"""`llmgw diff` of a replica across nodes: its shards by rank, what each node must hold, and the
weights fetched on the head alone (a llama.cpp worker gets its layers from the head)."""

from __future__ import annotations

import html

from llmgw.catalog import Catalog
from llmgw.plan import DiffReport, FleetSnapshot, make_plan, render_json, render_markdown, render_text
from tests.placement.fleet import inventory, model, node, profile


def test_diff_shows_the_shards_by_rank_and_fetches_on_the_head_only() -> None:
    split = model("smol", profile("split", gpus=0, nodes=3, fabric="lan", memory_gb=2, engine="llama.cpp"),
                  size_gb=0.5, source="https://example.com/smol.gguf")
    inv = inventory(*(node(n, gpus=0, fabric="lan", ram_gb=16, disk_gb=d) for n, d in (("a", 0), ("b", 50), ("c", 0))))
    head = Catalog(models=(split,), nodes=tuple(n.spec for n in inv.nodes.values()))
    plan = make_plan(None, head, FleetSnapshot(inv), now=0)
    report = DiffReport("HEAD", "working tree", (), (), plan)

    text = render_text(report)
    assert "  + start   smol/split on b gpus -, a gpus -, c gpus -  (scaling.min 1)\n" \
           "      rank 0 (head) on b: no GPU, 2 GB RAM, the weights of smol (0.5 GB)\n" \
           "      rank 1 (worker) on a: no GPU, 2 GB RAM, no weights (the head sends its layers)\n" \
           "      rank 2 (worker) on c: no GPU, 2 GB RAM, no weights (the head sends its layers)\n" in text, text
    assert plan.fetches == (("b", "smol", 0.5, "https://example.com/smol.gguf"),)  # read from the origin
    assert "fetch   b: weights of smol (0.5 GB)" in text and "fetch   a" not in text

    md = html.unescape(render_markdown(report))  # as its reader sees it (catalog text is escaped)
    assert ("| start | smol/split | rank 0 (head) on b: no GPU, 2 GB RAM, the weights of smol (0.5 GB)"
            "<br>rank 1 (worker) on a") in md

    [step] = render_json(report)["plan"]["steps"]
    assert [(s["node"], s["rank"], s["role"], s["holds_weights"]) for s in step["shards"]] == [
        ("b", 0, "head", True), ("a", 1, "worker", False), ("c", 2, "worker", False)]
