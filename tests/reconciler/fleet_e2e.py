"""A catalog repository and a controller for end-to-end tests on real sshd nodes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.contract import Demand, Endpoint, PromptCache, ReplicaStats
from llmgw.control import Controller, ControllerConfig
from llmgw.decide import ReplicaState
from llmgw.reconciler import ReconcilerConfig
from tests.conftest import commit_files, git
from tests.fixtures.sshd_fleet import SshdFleet

LLMGW_YAML = "pools:\n  - name: default\n"


def nodes_yaml(fleet: SshdFleet) -> str:
    lines = ["nodes:"]
    for i, n in enumerate(fleet, start=1):
        lines += [f"  - id: n{i}", f"    address: {n.host}", f"    port: {n.port}", "    user: root",
                  "    gpus: {count: 2, class: sim, memory_gb: 24}", "    disk_gb: 100"]
    return "\n".join(lines) + "\n"


def sim_model(name: str, source: str, *, min_: int = 1, max_: int = 3, idle_after: str | None = None,
              args: Sequence[str] = ()) -> str:
    scaling = f"scaling:\n  min: {min_}\n  max: {max_}\n" + (f"  idle_after: {idle_after}\n" if idle_after else "")
    extra = f"    args: {list(args)!r}\n".replace("'", '"') if args else ""
    return (f"name: {name}\nsource: {source}\nsize_gb: 0.1\n{scaling}"
            f"profiles:\n  - name: sim\n    engine: sim\n    gpus: 1\n    gpu_class: [sim]\n{extra}")


@dataclass
class Recorder:
    """The endpoint sink and usage source a router would be: it records and reports."""

    history: list[list[Endpoint]] = field(default_factory=list)
    used: dict[str, float] = field(default_factory=dict)
    wanted: dict[str, Demand] = field(default_factory=dict)
    unrunnable: dict[str, str] = field(default_factory=dict)
    unrunnable_history: list[dict[str, str]] = field(default_factory=list)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        self.history.append(list(endpoints))

    def set_unrunnable(self, reasons: Mapping[str, str]) -> None:
        self.unrunnable = dict(reasons)
        self.unrunnable_history.append(dict(reasons))

    @property
    def current(self) -> list[Endpoint]:
        return self.history[-1] if self.history else []

    def last_used(self) -> Mapping[str, float]:
        return dict(self.used)

    def demand(self) -> Mapping[str, Demand]:
        return dict(self.wanted)

    def prompt_cache(self) -> Mapping[str, PromptCache]:
        return {}

    def replica_stats(self) -> Mapping[str, Mapping[str, ReplicaStats]]:
        return {}

    def engine_queue(self) -> Mapping[str, tuple[int, int]]:
        return {}

    reads_engines = False  # the routers' word on demand stands

    def in_flight_by_replica(self) -> Mapping[str, int]:
        return {}


@dataclass
class CatalogRepo:
    path: Path

    def commit(self, files: dict[str, str | None], message: str) -> str:
        return commit_files(self.path, files, message)


def make_repo(tmp: Path, fleet: SshdFleet, models: dict[str, str]) -> CatalogRepo:
    path = tmp / "catalog"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    repo = CatalogRepo(path)
    repo.commit({"llmgw.yaml": LLMGW_YAML, "nodes.yaml": nodes_yaml(fleet),
                 **{f"models/{k}.yaml": v for k, v in models.items()}}, "Initial catalog")
    return repo


def make_controller(repo: CatalogRepo, data: Path, fleet: SshdFleet, recorder: Recorder,
                    clock: Callable[[], float] = time.time, **rc) -> Controller:
    config = ControllerConfig(
        repo=str(repo.path), data_dir=data, fetch_interval=0.5, watch=False,
        ssh_key=fleet.client_key, known_hosts=fleet.known_hosts,
        reconciler=ReconcilerConfig(**{"tick_interval": 0.3, "unreachable_grace": 2.0, "backoff_base": 0.3,
                                       "probe_timeout": 2.0, "stop_grace": 3.0, **rc}),
    )
    return Controller(config, sink=recorder, usage=recorder, clock=clock)


async def until(check: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        await asyncio.sleep(0.05)


def ready(c: Controller, model: str | None = None) -> list:
    return [r for r in c.reconciler.snapshot()
            if r.state == ReplicaState.READY and (model is None or r.model == model)]
