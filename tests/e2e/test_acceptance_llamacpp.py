"""Acceptance on a real engine (issue 37): llama.cpp serving SmolLM2-135M through `llmgw controller`
over an sshd node, a canary rollout policy with two acceptance prompts.

A commit that gives the model the wrong chat template (`--chat-template llama2`: llama-server then
wraps the question in another model's markup, and SmolLM2 answers about something else entirely,
with a 200 and at full speed) is caught before any client sees it: its canary is asked the
prompts, fails them, is rolled back with the prompt, what was expected and the answer in the
event, and never becomes ready (so never enters the router's list). The serving version answered
the same prompts when it started, and still serves. Answers are deterministic (temperature 0, a
fixed seed), and SmolLM2 with its own template says "blue" and "Shakespeare" to these.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import git
from tests.e2e.processes import catalog_repo, controller_config, start, stop, wait_for
from tests.e2e.test_llamacpp_fleet import BINARY, GGUF, TOKEN, admin, requires_engine
from tests.fixtures.confinement import confined_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MODEL = """\
name: smollm2
source: {source}
size_gb: 0.2
scaling: {{min: 1, max: 1}}
profiles:
  - name: cpu
    engine: llama.cpp
    gpus: 0
    memory_gb: 1
    args: {args}
rollout:
  strategy: canary
  steps: [50]
  interval: 2s
  checks: {{min_requests: 3}}
  acceptance:
    - name: sky
      messages: [{{role: user, content: "What color is the sky on a clear day?"}}]
      max_tokens: 24
      expect: {{contains: [blue]}}
    - name: author
      messages: [{{role: user, content: "Who wrote Romeo and Juliet?"}}]
      max_tokens: 24
      expect: {{contains: [Shakespeare]}}
"""
ARGS = ["--ctx-size", "2048", "--threads", "1"]


@requires_engine
def test_a_broken_chat_template_is_caught_before_any_client_sees_it(sshd_fleet, tmp_path) -> None:
    assert BINARY is not None and GGUF is not None
    confined = confined_settings()
    fleet = sshd_fleet(1, agent_extra={"engines": {"llama.cpp": str(BINARY)},
                                       "sandbox_paths": [*confined["sandbox_paths"], str(BINARY.parents[1])]})
    source = f"file://{GGUF}"
    repo = catalog_repo(tmp_path, fleet, {"smollm2": MODEL.format(source=source, args=json.dumps(ARGS))},
                        "SmolLM2 on llama.cpp, with acceptance prompts")
    model = repo / "models" / "smollm2.yaml"
    config, url = controller_config(tmp_path, "data", repo, fleet, TOKEN, fetch_interval="1s",
                                    reconciler={"tick_interval": "500ms", "stop_grace": "5s", "probe_timeout": "60s"})
    proc = start(["controller", "--config", str(config)], tmp_path / "controller.log")
    router_port = json.loads(config.read_text())["listen"]["router"].rsplit(":", 1)[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="unused", timeout=120,
                           max_retries=0)

    def events(after: int = 0) -> list[dict]:
        return [e for e in admin(url, "/api/v1/events?limit=1000") if e["id"] > after]

    try:
        # The serving version answers the prompts when it starts: ready, no finding.
        [stable] = wait_for(lambda: [r for r in admin(url, "/api/v1/replicas") if r["state"] == "ready"] or None,
                            180, "the llama.cpp replica ready (after its acceptance prompts)", proc)
        assert not [e for e in events() if e["kind"] == "replica-acceptance-failed"]
        sky = client.chat.completions.create(model="smollm2", max_tokens=24, temperature=0, seed=0,
                                             messages=[{"role": "user", "content": "What color is the sky?"}])
        assert sky.choices[0].message.content

        mark = max(e["id"] for e in events())
        model.write_text(MODEL.format(source=source, args=json.dumps([*ARGS, "--chat-template", "llama2"])))
        git(repo, "commit", "-qam", "smollm2: another chat template")
        back = wait_for(lambda: next((e for e in events(mark) if e["kind"] in (
            "rollout-rolled-back", "rollout-promoted", "rollout-done")), None), 240, "the rollout's end", proc)
        assert back["kind"] == "rollout-rolled-back", back
        assert "acceptance 'sky' failed" in back["message"] and "What color is the sky on a clear day?" in \
            back["message"] and 'expected it to contain "blue"' in back["message"], back
        later = events(mark)
        [canary] = {e["subject"] for e in later if e["kind"] == "replica-acceptance-failed"}
        assert canary != stable["id"]
        assert [e for e in later if e["kind"] == "replica-ready" and e["subject"] == canary] == []
        # The serving version goes on answering, on the same replica.
        wait_for(lambda: not [r for r in admin(url, "/api/v1/replicas") if r["id"] == canary], 60,
                 "the canary stopped", proc)
        again = client.chat.completions.create(model="smollm2", max_tokens=24, temperature=0, seed=0,
                                               messages=[{"role": "user", "content": "Who wrote Romeo and Juliet?"}])
        assert "Shakespeare" in (again.choices[0].message.content or "")
        assert [r["id"] for r in admin(url, "/api/v1/replicas") if r["state"] == "ready"] == [stable["id"]]
    finally:
        stop(proc)
