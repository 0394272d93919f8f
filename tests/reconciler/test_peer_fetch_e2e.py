"""Four sshd nodes start one model together: the origin is read about once. The first node reads
the origin; the others follow it, reading each chunk from that node's peer server as it has it,
then the rest by its chunk list (each with a token the controller issued for that fetch, every
chunk checked). The origin holds its second half back until the controller says a node follows,
so following is what is tested, not a copy read after the fact. Real parts: sshd, the agent, an
HTTP origin that counts what it sends, the simulator as the engine."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.agent.parts.protocol import PEER_CHUNK
from llmgw.engines.testing import free_port
from tests.reconciler.fleet_e2e import Recorder, make_controller, make_repo, ready, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
WEIGHTS = os.urandom(PEER_CHUNK + 1_000_000)  # two chunks
PEER_PORT = free_port()


class Origin:
    """An HTTP origin serving one file, counting the bytes it sends."""

    def __init__(self) -> None:
        self.sent = 0
        self.release = threading.Event()  # the second half is sent once this is set
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                start = 0
                if (rng := self.headers.get("Range", "")).startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                body = WEIGHTS[start:]
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(WEIGHTS) - 1}/{len(WEIGHTS)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                held = max(0, PEER_CHUNK + 4096 - start)  # the first chunk and a little
                self.wfile.write(body[:held])
                self.wfile.flush()
                origin.release.wait(120)
                self.wfile.write(body[held:])
                origin.sent += len(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/weights/model.safetensors"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def origin() -> Iterator[Origin]:
    made = Origin()
    yield made
    made.release.set()
    made.server.shutdown()
    made.server.server_close()


@pytest.fixture(scope="module")
def fleet(sshd_fleet):  # noqa: ANN001, ANN201
    return sshd_fleet(4, agent_extra=lambda node: {"peer_port": PEER_PORT, "fabric_address": node.host})


def model_yaml(source: str, replicas: int) -> str:
    # Two GPUs a replica, two a node: one replica on each node.
    return (f"name: chat\nsource: {source}\nsize_gb: 0.1\nscaling:\n  min: {replicas}\n  max: {replicas}\n"
            "profiles:\n  - name: sim\n    engine: sim\n    gpus: 2\n    gpu_class: [sim]\n")


async def test_four_nodes_starting_one_model_read_the_origin_about_once(fleet, tmp_path: Path,  # noqa: ANN001
                                                                        origin: Origin) -> None:
    repo = make_repo(tmp_path, fleet, {"chat": model_yaml(origin.url, 4)})
    c = make_controller(repo, tmp_path / "data", fleet, Recorder())
    await c.start()
    try:
        def followed() -> bool:
            return any("as it reads the origin" in str(f.get("from")) for nodes in c.ops.fetches().values()
                       for f in nodes.values())

        await until(followed, timeout=120, what="a node following the one reading the origin")
        origin.release.set()
        await until(lambda: len(ready(c)) == 4, timeout=180, what="4 ready replicas, one a node")
        assert sorted(r.nodes[0] for r in ready(c)) == ["n1", "n2", "n3", "n4"]
        assert origin.sent <= len(WEIGHTS) * 1.05, (origin.sent, len(WEIGHTS))
        name = c.desired.catalog.model("chat").cache_name
        for node in fleet:
            assert (node.cache_dir / name / "model.safetensors").read_bytes() == WEIGHTS
        served = [n for n in fleet if (n.state_dir / "peer-server.json").exists()]
        assert served, "no node served another"
    finally:
        await c.close()


async def test_a_restarted_controller_has_holders_serve_without_reading_the_origin_again(
        fleet, tmp_path: Path, origin: Origin) -> None:  # noqa: ANN001
    """The digest a reader checks a holder's list against is the one the controller kept from the
    node that read the origin: kept in the store, so a controller started again (or the next
    leader) has the next nodes read from the holders, not the origin once more."""
    origin.release.set()  # nothing to follow here: two nodes fetch, then two more after a restart
    repo = make_repo(tmp_path, fleet, {"chat": model_yaml(origin.url, 2)})
    c = make_controller(repo, tmp_path / "data", fleet, Recorder())
    await c.start()
    try:
        await until(lambda: len(ready(c)) == 2, timeout=180, what="2 ready replicas")
    finally:
        await c.close()
    assert origin.sent <= len(WEIGHTS) * 1.05
    repo.commit({"models/chat.yaml": model_yaml(origin.url, 4)}, "Four replicas")
    c = make_controller(repo, tmp_path / "data", fleet, Recorder())
    await c.start()
    try:
        await until(lambda: len(ready(c)) == 4, timeout=180, what="4 ready replicas after the restart")
        assert origin.sent <= len(WEIGHTS) * 1.05, (origin.sent, len(WEIGHTS))
    finally:
        await c.close()
