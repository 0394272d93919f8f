"""Who sees tenants' names and usage in Prometheus (issue 24), on real processes: `llmgw controller`
with its own router, and a standalone `llmgw router --metrics-listen`, a tenant's key used on both.

The client port's /metrics needed no key and listed every tenant and key with what each spent.
Now it carries the router's own series only; an operator scrapes usage per tenant and key from
the admin listener's /api/v1/metrics, or a standalone router's metrics listener, with the admin
token."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from llmgw.router import hash_key
from tests.e2e.processes import SIM_CHAT_MODEL_YAML, free_port, local_controller, start, stop_everything, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # its waits allow 90 s (the default timeout: 60)
TOKEN = "metrics-admin-token"
LLMGW_YAML = """\
pools:
  - name: local
tenants:
  - name: acme-corp
    keys: [acme-prod-key]
"""
NAMES = ("acme-corp", "acme-prod-key")


def get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def served(base: str) -> bool:
    c = openai.OpenAI(base_url=base + "/v1", api_key="sk-acme", timeout=20, max_retries=0)
    try:
        return bool(c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5).choices)
    except (openai.APIConnectionError, openai.APIStatusError):
        return False


def usage_line(text: str) -> bool:
    return any(line.startswith("llmgw_router_usage_tokens_total{") and all(f'"{n}"' in line for n in NAMES)
               for line in text.splitlines())


def test_usage_per_tenant_and_key_is_served_behind_the_admin_token_only(tmp_path: Path) -> None:
    c = local_controller(tmp_path, model_yaml=SIM_CHAT_MODEL_YAML, token=TOKEN, llmgw_yaml=LLMGW_YAML,
                         api_keys=[{"name": "acme-prod-key", "sha256": hash_key("sk-acme")}])
    own_port, metrics_port = free_port(), free_port()
    controller_router, admin = c.router, c.admin
    standalone, metrics = f"http://127.0.0.1:{own_port}", f"http://127.0.0.1:{metrics_port}/metrics"
    controller = start(["controller", "--config", str(c.config)], tmp_path / "controller.log")
    router = None
    try:
        wait_for(lambda: served(controller_router), 90, "the controller's router serving the tenant", controller)
        router = start(["router", "--controller", admin, "--listen", f"127.0.0.1:{own_port}",
                        "--metrics-listen", f"127.0.0.1:{metrics_port}"], tmp_path / "router.log",
                       env={"LLMGW_ADMIN_TOKEN": TOKEN})
        wait_for(lambda: served(standalone), 60, "the standalone router serving the tenant", router)

        # Anyone reaching a client port: the router's own series, no customer's name.
        for base in (controller_router, standalone):
            status, text = get(base + "/metrics")
            assert status == 200 and "llmgw_router_requests_total" in text, text[:300]
            assert not any(n in text for n in NAMES) and "tenant=" not in text and "key=" not in text, base
            # A client's key opens nothing more (not compared with the scrape above: series come and
            # go between two scrapes, as an engine's load is polled; seen in CI).
            keyed = get(base + "/metrics", "sk-acme")[1]
            assert "llmgw_router_requests_total" in keyed and not any(n in keyed for n in NAMES)
            assert "tenant=" not in keyed and "key=" not in keyed, base

        # The operator, with the admin token: the admin listener, and the standalone router's own listener.
        assert get(admin + "/api/v1/metrics")[0] == 401
        status, text = get(admin + "/api/v1/metrics", TOKEN)
        assert status == 200 and usage_line(text), text[-2000:]
        assert get(metrics)[0] == 401 and get(metrics, "sk-acme")[0] == 401
        status, text = get(metrics, TOKEN)
        assert status == 200 and usage_line(text) and "llmgw_router_requests_total" in text, text[-2000:]
    finally:
        stop_everything([router, controller] if router is not None else [controller], c.data)
