"""A node's owner decides what engines run and where weights are read (its agent config, DESIGN §4);
placement, `explain` and `llmgw diff` plan within what the node reports it offers, rather than
promising a start the node then refuses (seen: "+ start smollm2/cpu on local", four refusals)."""

from __future__ import annotations

from dataclasses import replace

from llmgw.inventory import Offers
from llmgw.placement import explain, place
from tests.placement.fleet import catalog, inventory, model, node, profile

OFFERS = Offers(engines=("sim", "vllm"), local_roots=("/srv/exports", "/srv/models"), model_dirs=("/srv/models",))


def offering(n, offers: Offers = OFFERS):  # noqa: ANN001, ANN201
    return replace(n, report=replace(n.report, offers=offers))


def placed(m, *nodes) -> bool:  # noqa: ANN001
    return bool(place(catalog(m), inventory(*nodes), [], now=0.0, wanted={m.name: 1}).placements)


def test_an_engine_the_node_does_not_have_is_not_placed_there_and_explain_says_so() -> None:
    m = model("smollm2", profile("cpu", gpus=0, engine="llama.cpp"), source="/srv/models/s.gguf")
    assert not placed(m, offering(node("local")))
    text = "\n".join(explain(catalog(m), inventory(offering(node("local"))), [], "smollm2").lines())
    assert "node has no llama.cpp engine (its agent config has sim, vllm)" in text
    assert placed(m, offering(node("local"), replace(OFFERS, engines=("llama.cpp",))))


def test_weights_outside_what_the_node_reads_are_not_placed_there() -> None:
    vllm = profile("cpu", gpus=0)
    assert placed(model("a", vllm, source="/srv/models/a"), offering(node("n")))
    assert not placed(model("b", vllm, source="/root/b"), offering(node("n")))  # a plain path: model_dirs only
    assert placed(model("c", vllm, source="file:///srv/exports/c.gguf"), offering(node("n")))
    assert not placed(model("d", vllm, source="file:///srv/exports/../../etc/d"), offering(node("n")))
    assert not placed(model("e", vllm, source="file:///root/e"), offering(node("n")))
    assert placed(model("f", vllm, source="hf://org/f"), offering(node("n")))  # fetched: nothing to check


def test_a_node_that_reports_no_offers_is_judged_by_its_answer_to_the_start() -> None:
    m = model("x", profile("cpu", gpus=0, engine="llama.cpp"), source="/anywhere/x.gguf")
    assert placed(m, node("old-agent"))


def test_env_the_node_does_not_allow_and_a_broken_sandbox_are_said_before_the_node_refuses() -> None:
    """The sandbox half of what a node refuses: a profile's env outside the node's env_allow, and a
    node whose confinement cannot run (it reports why, and refuses every start)."""
    from llmgw.inventory.model import Confinement

    m = model("chat", replace(profile("cpu", gpus=0), env=(("SIM_DIAL", "1"),)), source="hf://org/chat")
    n = offering(node("n"))
    allowing = replace(n, report=replace(n.report, env_allow=("HF_HOME", "SIM_DIAL")))
    denying = replace(n, report=replace(n.report, env_allow=("HF_HOME",)))
    assert placed(m, allowing) and not placed(m, denying)
    text = "\n".join(explain(catalog(m), inventory(denying), [], "chat").lines())
    assert "node does not allow env SIM_DIAL (its env_allow)" in text
    broken = replace(allowing, report=replace(allowing.report, confinement=Confinement(
        "llmgw-engine", "bwrap", problem="bubblewrap cannot run here (setting up uid map: Permission denied)")))
    assert not placed(m, broken)
    text = "\n".join(explain(catalog(m), inventory(broken), [], "chat").lines())
    assert "refuses every start until its owner fixes its sandbox: bubblewrap cannot run here" in text


def test_env_only_the_owner_sets_is_said_whatever_env_allow_says() -> None:
    m = model("chat", replace(profile("cpu", gpus=0), env=(("HF_HUB_OFFLINE", "0"),)), source="hf://org/chat")
    n = offering(node("n"), replace(OFFERS, owner_env=("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS")))
    allowing = replace(n, report=replace(n.report, env_allow=("HF_HUB_OFFLINE",)))
    assert not placed(m, allowing)
    text = "\n".join(explain(catalog(m), inventory(allowing), [], "chat").lines())
    assert "env HF_HUB_OFFLINE is set by the node's owner only (its engine_env)" in text
