"""The node boundary on the real agent (DESIGN §4): whatever a start request says, the engine
gets only the env, files and identity the node's owner allows.

Each test asserts the effect did not happen (no file written, no file read back, no command
run), not only that a check fired. A hostile engine stands in for the worst case the checks
cannot see: an engine running the caller's code (vLLM's --trust-remote-code with fetched
weights is exactly that), so its confinement must hold by itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.agent.helpers import Node, make_entry, wait_for

BWRAP = os.path.exists("/usr/bin/bwrap")
ROOT = os.geteuid() == 0

# Tries everything a compromised engine would, and prints what worked as one JSON line.
HOSTILE = r"""
import json, os, sys
targets = json.load(open(sys.argv[1]))
found = {"uid": os.getuid(), "euid": os.geteuid(), "read": [], "wrote": [], "listed": [], "signalled": []}
for path in targets["read"]:
    try:
        with open(path, "rb") as fh:
            found["read"].append([path, fh.read(64).decode("latin-1")])
    except OSError:
        pass
for path in targets["list"]:
    try:
        found["listed"].append([path, os.listdir(path)])
    except OSError:
        pass
for path in targets["write"]:
    try:
        with open(path, "w") as fh:
            fh.write("pwned")
        found["wrote"].append(path)
    except OSError:
        pass
for pid in targets["kill"]:
    try:
        os.kill(pid, 0)
        found["signalled"].append(pid)
    except OSError:
        pass
print("HOSTILE " + json.dumps(found), flush=True)
"""


def hostile_node(node: Node) -> None:
    node.write_config(engines={**node.settings["engines"], "hostile": [sys.executable, "-c", HOSTILE]})


def run_hostile(node: Node, targets: dict, entry: Path, replica: str = "h") -> dict:
    # The targets travel inside the engine's weights (caller-chosen content, as fetched weights are).
    (entry / "targets.json").write_text(json.dumps(targets))
    node.ok("start", {"replica_id": replica, "engine": "hostile", "args": ["{weights}/targets.json"],
                      "weights": entry.name})
    log = node.state / "logs" / "engines" / f"{replica}.log"
    line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith("HOSTILE ")), None))
    return json.loads(line[len("HOSTILE "):])


# ---------------------------------------------------------------------------------------------
# env: an allow-list, so the vectors a deny-list missed are refused and never run


@pytest.mark.parametrize("env", [
    # The vector seen from outside: a warnings filter imports `antigravity`, which opens a "browser".
    {"PYTHONWARNINGS": "ignore::antigravity.X", "BROWSER": "/bin/sh -c 'touch {marker}' %s"},
    {"BROWSER": "/bin/sh -c 'touch {marker}' %s"},
    {"PYTHONSTARTUP": "{marker}"}, {"PYTHONINSPECT": "1"}, {"PYTHONHOME": "/tmp"},
    {"LD_AUDIT": "/tmp/x.so"}, {"GLIBC_TUNABLES": "glibc.malloc.mxfast=0"}, {"GCONV_PATH": "/tmp"},
    {"LLAMA_ARG_LOG_FILE": "{marker}"}, {"LLAMA_ARG_STATIC_PATH": "/"}, {"LLAMA_ARG_MODEL": "/etc/shadow"},
    {"GGML_BACKEND_PATH": "/tmp/x.so"}, {"VLLM_PLUGINS": "evil"}, {"VLLM_LOGGING_CONFIG_PATH": "{marker}"},
    {"VLLM_CONFIG_ROOT": "/"}, {"SGLANG_PLUGINS": "evil"}, {"HF_HOME": "/"}, {"HF_ENDPOINT": "http://evil"},
    {"NCCL_NET_PLUGIN": "/tmp/x.so"}, {"NCCL_DEBUG_FILE": "{marker}"}, {"TRITON_CACHE_DIR": "/"},
    {"HTTPS_PROXY": "http://127.0.0.9:1"}, {"SSL_CERT_FILE": "/tmp/ca"}, {"TMPDIR": "/"}, {"HOME": "/"},
    {"XDG_CONFIG_HOME": "/tmp"}, {"PATH": "/tmp"}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
])
def test_env_outside_the_allow_list_is_refused_and_nothing_runs(node: Node, env: dict[str, str]) -> None:
    marker = node.root / "marker"
    request_env = {k: v.replace("{marker}", str(marker)) for k, v in env.items()}
    code, answer = node.run("start", {"replica_id": "r", "engine": "pyecho", "env": request_env})
    assert code != 0 and answer["refused"] == {"setting": "env_allow"}, answer
    assert sorted(request_env)[0] in answer["error"]
    assert not (node.state / "engines" / "r.json").exists()
    assert not marker.exists()


def test_the_default_allow_list_reaches_the_engine_and_nothing_else_of_the_agents_env(node: Node) -> None:
    env = node.env(AWS_SECRET_ACCESS_KEY="root-login-secret", SSH_AUTH_SOCK="/tmp/agent.sock")
    node.write_config(engines={**node.settings["engines"], "printenv": [sys.executable, "-c",
                               "import json, os; print('ENV ' + json.dumps(dict(os.environ)), flush=True)"]})
    node.ok("start", {"replica_id": "e", "engine": "printenv", "env": {"OMP_NUM_THREADS": "3"}, "gpus": [1]},
            env=env)
    log = node.state / "logs" / "engines" / "e.log"
    line = wait_for(lambda: next((x for x in log.read_text().splitlines() if x.startswith("ENV ")), None))
    seen = json.loads(line[4:])
    assert seen["OMP_NUM_THREADS"] == "3" and seen["CUDA_VISIBLE_DEVICES"] == "1"
    assert "AWS_SECRET_ACCESS_KEY" not in seen and "SSH_AUTH_SOCK" not in seen
    assert seen["HOME"].endswith("/run/e")  # the engine's own area, never the agent's home


def test_a_name_the_owner_allows_even_a_dangerous_one_stays_inside_the_sandbox(node: Node) -> None:
    """Defence in depth: an owner who allows BROWSER and PYTHONWARNINGS by mistake still does not
    hand the caller the node: the command runs as the engine user, in the sandbox, whose /tmp
    is its own."""
    if not BWRAP:
        pytest.skip("bubblewrap is not installed")
    marker = Path("/tmp") / f"llmgw-browser-{os.getpid()}"
    node.write_config(env_allow=["LLMGW_TEST_VALUE", "PYTHONWARNINGS", "BROWSER"])
    env = {"PYTHONWARNINGS": "ignore::antigravity.X", "BROWSER": f"/bin/sh -c 'id > {marker}' %s"}
    node.ok("start", {"replica_id": "b", "engine": "pyecho", "env": env})
    log = node.state / "logs" / "engines" / "b.log"
    wait_for(lambda: "argv" in log.read_text())  # the engine ran to its end
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# identity and sandbox


@pytest.mark.skipif(not ROOT, reason="switching users needs an agent running as root")
def test_a_root_agent_without_engine_user_refuses_to_start_engines_as_root(node: Node) -> None:
    node.settings.pop("engine_user")
    node.write_config()
    code, answer = node.run("start", {"replica_id": "r", "engine": "pyecho"})
    assert code != 0 and answer["refused"] == {"setting": "engine_user"}, answer
    assert "engines_as_root" in answer["error"]
    assert node.ok("inventory")["confinement"]["problem"]
    # Only an explicit setting runs them as root.
    node.write_config(engines_as_root=True)
    node.ok("start", {"replica_id": "r", "engine": "pyecho"})
    assert json.loads((node.state / "engines" / "r.json").read_text())["user"] == "root"


def test_inventory_reports_the_confinement(node: Node) -> None:
    conf = node.ok("inventory")["confinement"]
    assert conf["user"] == ("nobody" if ROOT else conf["user"]) and conf["problem"] is None
    assert conf["sandbox"] == ("bwrap" if BWRAP else "none"), conf


def test_sandbox_bwrap_required_but_missing_refuses_every_start(node: Node) -> None:
    node.write_config(sandbox="bwrap", bwrap=str(node.root / "no-such-bwrap"))
    code, answer = node.run("start", {"replica_id": "r", "engine": "pyecho"})
    assert code != 0 and answer["refused"] == {"setting": "sandbox"}, answer
    assert "bubblewrap is not installed" in answer["error"]


def test_a_hostile_engine_cannot_read_write_list_or_signal_outside_its_area(node: Node) -> None:
    """An engine running the caller's code: the files the node keeps from it stay unread and
    unwritten whatever it tries."""
    hostile_node(node)
    secret = node.root / "root-only.key"
    secret.write_text("ROOT-ONLY-SECRET")
    secret.chmod(0o600)
    other = make_entry(node.cache, "hf://someone/else")
    (other / "weights.bin").chmod(0o644)
    mine = make_entry(node.cache, "hf://me/mine")
    (node.state / "engines").mkdir(exist_ok=True)
    outside = node.root / "written-by-engine"
    pid_of_test = os.getpid()
    found = run_hostile(node, {
        "read": [str(secret), str(other / "weights.bin"), str(node.config), "/root/.ssh/authorized_keys",
                 "/etc/shadow", str(mine / "weights.bin")],
        "list": [str(node.cache), str(node.state), str(node.state / "engines"), "/root"],
        "write": [str(outside), str(mine / "planted"), str(node.state / "engines" / "planted.json"),
                  "/etc/llmgw-planted"],
        "kill": [pid_of_test, 1 if not BWRAP else pid_of_test],
    }, mine)
    if ROOT:
        assert found["uid"] != 0 and found["euid"] != 0
    readable = [p for p, _ in found["read"]]
    # Its own weights, read-only, and nothing else.
    assert readable == [str(mine / "weights.bin")], found
    assert found["read"][0][1] != "ROOT-ONLY-SECRET"
    assert found["wrote"] == [], found
    assert not outside.exists() and not (mine / "planted").exists()
    assert not Path("/etc/llmgw-planted").exists()
    if BWRAP:
        # Other cache entries, agent state and homes are not there at all; no host pid is visible.
        listed = dict((p, sorted(e)) for p, e in found["listed"])
        assert listed[str(node.cache)] == [mine.name], listed  # its own entry, bound back alone
        assert listed[str(node.state)] == ["run"], listed  # only the way to its own area
        assert str(node.state / "engines") not in listed, listed
        exposed_in_root = sorted({Path(p).relative_to("/root").parts[0] for p in node.settings["sandbox_paths"]
                                  if p.startswith("/root/")})
        assert listed.get("/root", []) == exposed_in_root, listed  # only what the owner exposed
        assert found["signalled"] == [], found


# ---------------------------------------------------------------------------------------------
# args that name files


LLAMA_VECTORS = [
    ["--path", "{secret_dir}"], ["--log-file", "{marker}"], ["--log_file", "{marker}"],
    ["--slot-save-path", "{secret_dir}"], ["--chat-template-file", "{secret}"], ["-lcd", "{marker}"],
    ["--lookup-cache-dynamic", "{marker}"], ["--log-prompts-dir", "{secret_dir}"], ["--media-path", "/"],
    ["--models-dir", "/"], ["--models-preset", "{secret}"], ["--api-key-file", "{secret}"],
    ["--ssl-key-file", "{secret}"], ["-m", "/etc/shadow"], ["--lora", "{secret}"], ["--grammar-file", "{secret}"],
    ["--host", "{marker}.sock"], ["--tools", "all"], ["--mcp-servers-config", "{secret}"], ["--agent"],
    ["--chat-template-file", "../../../../../../etc/shadow"], ["--log-file", "~/../../{marker}"],
    ["--slot-save-path", "{weights}"], ["--log-file", "file://{marker}"],
]


@pytest.mark.parametrize("args", LLAMA_VECTORS, ids=[" ".join(a) for a in LLAMA_VECTORS])
def test_llama_server_flags_that_reach_outside_are_refused_before_the_engine_runs(node: Node, args: list) -> None:
    """Checked with the engine named llama.cpp: the agent's flag table for llama-server."""
    marker, secret = node.root / "written", node.root / "secret.txt"
    secret.write_text("SECRET")
    entry = make_entry(node.cache, "hf://x/y")
    node.write_config(engines={**node.settings["engines"], "llama.cpp": [sys.executable, "-c", "print('ran')"]})
    values = {"{secret_dir}": str(node.root), "{marker}": str(marker), "{secret}": str(secret)}
    expanded = []
    for a in args:
        for k, v in values.items():
            a = a.replace(k, v)
        expanded.append(a)
    code, answer = node.run("start", {"replica_id": "l", "engine": "llama.cpp", "args": expanded,
                                      "weights": entry.name})
    assert code != 0 and "refused" in answer, answer
    assert args[0] in answer["error"] or "argument" in answer["error"]
    assert not (node.state / "engines" / "l.json").exists() and not marker.exists()


@pytest.mark.parametrize("args", [
    ["--distributed-executor-backend", "mp"], ["--distributed-executor-backend=uni"], ["-dpb", "mp"],
    ["--load-format", "safetensors"], ["--load-format=gguf"], ["-O", '{"backend": "inductor", "level": 3}'],
    ["--compilation-config", '{"backend": "eager"}'], ["-O3"], ["--compilation-config.backend", "inductor"],
])
def test_the_values_that_stay_on_the_node_are_allowed(agent_module: ModuleType, node: Node, args: list) -> None:
    area, weights = str(node.state / "run" / "x"), str(node.cache / ("llmgw-" + "a" * 64))
    agent_module.check_args("vllm", args, area=area, read_roots=(weights,))


def test_paths_inside_the_engine_area_and_its_weights_are_allowed(node: Node) -> None:
    entry = make_entry(node.cache, "hf://x/ok")
    node.write_config(engines={**node.settings["engines"], "llama.cpp": [sys.executable, "-c", "print('ran')"]})
    node.ok("start", {"replica_id": "ok", "engine": "llama.cpp", "weights": entry.name, "args": [
        "-m", "{weights}/weights.bin", "--chat-template-file", "{weights}/weights.bin", "--log-file", "engine.log",
        "--slot-save-path", "slots", "--host", "{host}", "--port", "{port}"]})


# Spellings an adversarial review found past an earlier version of the check.
ARG_BYPASSES = [
    # argparse short option with its value attached: -O<json> is --compilation-config <json>.
    ("vllm", ['-O{"cache_dir": "/root/.cache/x"}']),
    # vLLM's dotted form for -O: not a "--" name, so only an absolute value after "=" is seen.
    ("vllm", ["-O.cache_dir=../../../../../root/x"]),
    # Relative paths inside a JSON value are not checked at all (cwd is the area).
    ("vllm", ["--compilation-config", '{"cache_dir": "../../../../../root/x"}']),
    ("vllm", ["--speculative-config", '{"model": "../../../../../root/secret-model"}']),
    # A value starting with "[" or "{" that is not JSON skips the path check entirely.
    ("llama.cpp", ["--log-file", "[/../../../../../../etc/cron.d/x"]),
    ("llama.cpp", ["--chat-template-file", "{/../../../../../../etc/shadow"]),
    # name=path: the checker resolves "a=../x" as <area>/a=../x = <area>/x; the engine, as ../x.
    ("vllm", ["--lora-modules", "a=../victim/adapter"]),
    ("sglang", ["--lora-paths", "a=../victim/adapter"]),
    # vLLM's positional model (serve MODEL) reads a path, relative ones are never checked.
    ("vllm", ["serve", "../../../../../root/models/private"]),
    # llama-server flags that read a file and are missing from the table.
    ("llama.cpp", ["--model-vocoder", "../../../../../root/x.gguf"]),
    ("llama.cpp", ["-mv", "../../../../../root/x.gguf"]),
]

ARG_VECTORS = [
    ("vllm", ["serve", "{weights}", "--chat-template", "/etc/shadow"]),
    ("vllm", ["--chat-templ", "/etc/shadow"]),  # argparse abbreviation
    ("vllm", ["--chat_template=/etc/shadow"]),  # underscores and =
    ("vllm", ["--download-dir", "{weights}"]),  # written: weights are read-only to the engine
    ("vllm", ["--compilation-config.cache_dir", "/var/tmp/x"]),  # dotted JSON key
    ("vllm", ["--compilation-config", '{"cache_dir": "/root/x"}']),  # inside a JSON value
    ("vllm", ["--lora-modules", "a=/etc"]),
    ("vllm", ["--config", "/etc/llmgw/agent.json"]),
    ("vllm", ["--log-config-file", "~/../../../../etc/x"]),
    ("vllm", ["--tool-server", "demo"]),
    # vLLM 0.32.0's parser, option by option (llmgw/agent/parts/args.py).
    ("vllm", ["--log-config-file", "{weights}/logging.json"]),  # handlers to another machine, classes
    ("vllm", ["--logging-config", '{"pylogging_config_file": "logging.json"}']),
    ("vllm", ["--ec-manager-config", '{"encoder_cache_manager_cls": "os.system"}']),
    ("vllm", ["--mm-encoder-fp8-scale-path", "/etc/shadow"]),
    ("vllm", ["--mm-encoder-fp8-scale-save-path", "{weights}/scales"]),
    ("vllm", ["--data-parallel-rpc-port", "29550"]),  # a listener beside the agent's port
    ("vllm", ["-dpp", "29550"]),
    ("vllm", ["--structured-outputs-config", '{"reasoning_parser_plugin": "/etc/x.py"}']),
    ("vllm", ["--worker-extension-cls", "os.system"]),  # code to import
    ("vllm", ["--scheduler-cls", "x.Y"]),
    ("vllm", ["--logits-processors", "mod:Cls"]),
    ("vllm", ["--middleware", "mod.app"]),
    ("vllm", ["--model-class-overrides", '{"A": "mod:cls"}']),
    ("vllm", ["--kv-offloading-backend", "lmcache"]),  # every prompt's KV to an LMCache server
    # Values that run the engine elsewhere, load from elsewhere or import code (issue 40's leftovers).
    ("vllm", ["--distributed-executor-backend", "ray"]),  # workers on a Ray cluster
    ("vllm", ["--distributed-executor-backend=evil.module.Executor"]),  # a class to import
    ("vllm", ["--distributed_executor_backend", "ray"]),
    ("vllm", ["--distributed-executor", "ray"]),  # an abbreviation argparse takes
    ("vllm", ["-dpb", "ray"]),
    ("vllm", ["-dpbray"]),
    ("vllm", ["--data-parallel-backend", "ray"]),
    ("vllm", ["--load-format", "runai_streamer"]),  # streams from object storage
    ("vllm", ["--load-format=tensorizer"]),
    ("vllm", ["--load-format", "modelexpress"]),
    ("vllm", ["--load-format", "ipc_cache"]),
    ("vllm", ["--compilation-config", '{"backend": "evil.compile"}']),  # a function to import
    ("vllm", ["-O", '{"backend": "os.system"}']),
    ('vllm', ['-O{"backend": "x.y"}']),
    ("vllm", ["--compilation-config.backend", "evil.compile"]),
    ("vllm", ["--compilation-c", '{"backend": "evil.compile"}']),
    ("vllm", ["s3://bucket/model"]),  # a positional model tag the engine would load itself
    ("sglang", ["gs://bucket/model"]),
    ("sglang", ["--model-path", "/root/.ssh"]),
    ("sglang", ["--file-storage-path", "../../.."]),
    ("sglang", ["--delete-ckpt-after-loading"]),
    (None, ["--any-flag-at-all", "/etc/shadow"]),  # unknown engines: absolute paths are still checked
    (None, ["--x=file:///etc/shadow"]),
]


@pytest.mark.parametrize(("kind", "args"), ARG_VECTORS + ARG_BYPASSES,
                         ids=[f"{k}:{' '.join(a)}" for k, a in ARG_VECTORS + ARG_BYPASSES])
def test_vllm_and_sglang_path_flags_are_checked_in_every_spelling(node: Node, agent_module: ModuleType,
                                                                  kind: str | None, args: list) -> None:
    """vLLM and SGLang cannot run here (no GPU): their flag tables are checked in-process, on the
    same function the agent's start runs."""
    area, weights = str(node.state / "run" / "x"), str(node.cache / ("llmgw-" + "a" * 64))
    expanded = [a.replace("{weights}", weights) for a in args]
    with pytest.raises(agent_module.Refused):
        agent_module.check_args(kind, expanded, area=area, read_roots=(weights,))


def test_engine_kind_is_known_by_name_and_by_executable(agent_module: ModuleType) -> None:
    assert agent_module.engine_kind("vllm", ("/opt/vllm/bin/python",)) == "vllm"
    assert agent_module.engine_kind("big-llama", ("/usr/local/bin/llama-server",)) == "llama.cpp"
    assert agent_module.engine_kind("custom", ("/usr/bin/python3", "-m", "sglang.launch_server")) == "sglang"
    assert agent_module.engine_kind("sim", ("/usr/bin/python3", "-m", "llmgw.engines.sim")) is None
