"""Which engine flags name the machines a rank exchanges with across nodes, in every spelling the
engine takes. Pure and stdlib-only: the agent's args policy and the catalog's validation read it."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

# Flags naming the machine a rank exchanges with across nodes, and the form of their value:
# "rpc" a llama.cpp head's comma-separated --rpc host:port list, "host" an address, "hostport"
# host:port. A llama.cpp head sends its layers to its --rpc servers and trusts what they compute;
# every vLLM rank joins rank 0's --master-addr (torch.distributed rendezvous, vLLM's pickled
# message queues), a data-parallel rank its --data-parallel-address, an SGLang rank its
# --dist-init-addr (--nccl-init-addr, its older name): a tampered controller or a merged catalog
# commit must not point them at a machine of its own. One rule for all: the replica's own peers (the start
# request names them), inside the node's rpc_peers.
PEER_FLAGS: Dict[str, Dict[str, str]] = {
    "llama.cpp": {"--rpc": "rpc"},
    "vllm": {"--master-addr": "host", "--data-parallel-address": "host", "-dpa": "host"},
    "sglang": {"--dist-init-addr": "hostport", "--nccl-init-addr": "hostport"},
}


def _table_flag(kind: Optional[str], arg: str,
                tables: Dict[str, Dict[str, str]]) -> Optional[Tuple[str, str, Optional[str]]]:
    """(flag, form, attached value or None) when ``arg`` is a flag of its engine's table in any
    spelling the engine takes: --flag=value, --flag_name (vLLM, SGLang; llama-server's --log_file
    too: normalized for every engine, a spelling it refuses only fails to start), an argparse
    abbreviation (vLLM, SGLang), -dpaVALUE."""
    table = tables.get(kind or "")
    if not table or not arg.startswith("-"):
        return None
    name, eq, inline = arg.partition("=")
    value: Optional[str] = inline if eq else None
    if name.startswith("--"):
        normal = "--" + name[2:].replace("_", "-")
        if normal in table:
            return normal, table[normal], value
        if kind in ("vllm", "sglang") and len(normal) >= 4:
            matches = sorted(f for f in table if f.startswith(normal))
            if matches:
                return matches[0], table[matches[0]], value
        return None
    for flag in table:
        if name == flag:
            return flag, table[flag], value
        if kind in ("vllm", "sglang") and not eq and arg.startswith(flag) and len(arg) > len(flag):
            return flag, table[flag], arg[len(flag):]
    return None
