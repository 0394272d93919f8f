"""Time `llmgw validate` on a generated 1,000-model catalog, against check-jsonschema.

check-jsonschema (the validation peer, PEERS.md) runs the JSON Schema layer only over the
same files in the same run; llmgw runs both layers. Goal: the `llmgw validate` command,
end to end as an operator runs it, under 1 s (median of several runs).

    python bench/validate_bench.py [--quick] [--models N]

The last line of output is one JSON object (DESIGN §8).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "catalog"

MODEL = """\
# yaml-language-server: $schema=../../schemas/model.schema.json
name: model-{i:04d}
aliases: [alias-{i:04d}, m{i}]
task: chat
source: hf://org{org}/model-{i:04d}@rev{i}
size_gb: {size}
scaling:
  min: 0
  max: 4
  idle_after: 30m
  target_inflight: 16
fallbacks: [{fallback}]
profiles:
  - name: h100
    engine: vllm
    gpus: {gpus}
    gpu_class: [h100, a100]
    gpu_memory_gb: 40
    memory_gb: 64
    args: ["--max-model-len", "8192", "--tensor-parallel-size", "{gpus}"]
    env: {{VLLM_LOGGING_LEVEL: WARNING}}
  - name: l40s
    engine: sglang
    gpus: {gpus}
    gpu_class: [l40s]
    args: ["--tp", "{gpus}"]
"""


def generate(root: Path, n: int) -> None:
    (root / "models").mkdir(parents=True)
    shutil.copy(EXAMPLES / "llmgw.yaml", root / "llmgw.yaml")
    shutil.copy(EXAMPLES / "nodes.yaml", root / "nodes.yaml")
    for i in range(n):
        gpus = (1, 2, 4)[i % 3]
        fallback = f"model-{i - 1:04d}" if i else ""
        text = MODEL.format(i=i, org=i % 17, size=8 + i % 100, gpus=gpus, fallback=fallback)
        (root / "models" / f"model-{i:04d}.yaml").write_text(text)


def timed(argv: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    return time.perf_counter() - start, proc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer runs (under a minute)")
    parser.add_argument("--models", type=int, default=1000)
    args = parser.parse_args()
    runs = 3 if args.quick else 7
    bindir = Path(sys.executable).parent

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "catalog"
        generate(root, args.models)
        llmgw_cmd = [str(bindir / "llmgw"), "validate", str(root)]

        # In-process: the validation itself, without interpreter start-up and imports.
        sys.path.insert(0, str(REPO))
        from llmgw.catalog import read_directory, validate_files

        inproc = []
        for _ in range(runs):
            t0 = time.perf_counter()
            result = validate_files(read_directory(root))
            inproc.append(time.perf_counter() - t0)
        if not result.ok:
            print("\n".join(map(str, result.problems[:10])))
            raise SystemExit("generated catalog is not valid")

        cli = []
        for _ in range(runs):
            dt, proc = timed(llmgw_cmd, REPO)
            if proc.returncode != 0:
                raise SystemExit(f"llmgw validate failed: {proc.stdout}{proc.stderr}")
            cli.append(dt)

        peer = []
        peer_exe = bindir / "check-jsonschema"
        files = sorted(str(p) for p in (root / "models").glob("*.yaml"))
        peer_cmd = [str(peer_exe), "--schemafile", str(REPO / "schemas/model.schema.json"), *files]
        if peer_exe.exists():
            for _ in range(runs):
                dt, proc = timed(peer_cmd, REPO)
                if proc.returncode != 0:
                    raise SystemExit(f"check-jsonschema failed: {proc.stdout[-2000:]}")
                peer.append(dt)

    cli_median = statistics.median(cli)
    report = {
        "bench": "validate",
        "models": args.models,
        "runs": runs,
        "llmgw_validate_cli_median_s": round(cli_median, 4),
        "llmgw_validate_inprocess_median_s": round(statistics.median(inproc), 4),
        "check_jsonschema_median_s": round(statistics.median(peer), 4) if peer else None,
        "speedup_vs_check_jsonschema": round(statistics.median(peer) / cli_median, 2) if peer else None,
        "goal": "llmgw validate on a 1,000-model catalog under 1 s (CLI, median)",
        "met": cli_median < 1.0,
    }
    print(f"llmgw validate (CLI):        {cli_median * 1000:.0f} ms median of {runs}")
    print(f"llmgw validate (in-process): {report['llmgw_validate_inprocess_median_s'] * 1000:.0f} ms")
    if peer:
        print(f"check-jsonschema (schema only): {statistics.median(peer) * 1000:.0f} ms")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
