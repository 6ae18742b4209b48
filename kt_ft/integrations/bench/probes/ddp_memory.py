"""Memory of data-parallel kt-ft: RSS / PSS / Private per rank and total PSS for 1, 2, 4 processes.

Builds (once) a demo model with larger routed experts (qwen3_moe, 2 MoE layers, 64 experts,
H 128, I 1536, fp32: 302 MB of expert weights), then for each process count runs

    FORCE_TORCHRUN=1 NPROC_PER_NODE=N llamafactory-cli train recipes/demo_tiny_qwen3moe.yaml ...

with ``KT_FT_RUN_REPORT`` set: at the end of training every rank writes its
``/proc/self/smaps_rollup`` figures and those of the shared expert mapping (see
``kt_ft/runtime/memory.py``), all ranks at the same moment. Prints one table row per rank and a total
per run. PSS summed over a machine's processes is their real memory: it should grow by the
per-process overhead (torch, LLaMA-Factory, non-expert weights), not by one expert copy per rank.

    .venv/bin/python -m kt_ft.integrations.bench.probes.ddp_memory --procs 1 2 4 --private 2 --work /tmp/ddp_memory

(``--private 2``: also 2 processes with ``KT_FT_SHARED_DIR=off``, each holding its own copy.)

Needs ``torchrun`` on PATH (the venv's bin) and a source checkout (its ``recipes/``); runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]  # the checkout: kt_ft/integrations/bench/probes/ is 4 below
RECIPE = REPO / "recipes" / "demo_tiny_qwen3moe.yaml"
BIG_EXPERTS = {"num_experts": 64, "moe_intermediate_size": 1536, "hidden_size": 128}
MiB = 2**20


def build_model(work: Path, overrides: dict) -> Path:
    demo = work / "demo"
    if not (demo / "model" / "config.json").is_file():
        from kt_ft.integrations.demo.text import make_demo_model  # why: only when the demo is not built yet

        make_demo_model(demo, **overrides)
    return demo


def run(demo: Path, work: Path, procs: int, steps: int, cpu_infer: int, share: bool = True) -> list[dict]:
    """Train ``steps`` steps on ``procs`` processes; return the ranks' memory records."""
    tag = f"{procs}" if share else f"{procs}-private"
    report = work / f"report{tag}"
    for old in report.glob("rank*.json"):
        old.unlink()
    cli = Path(sys.executable).with_name("llamafactory-cli")
    args = {
        "model_name_or_path": demo / "model",
        "dataset_dir": demo / "data",
        "output_dir": work / f"out{tag}",
        "max_steps": steps,
        "save_steps": 1000,
        "per_device_train_batch_size": 2,
        "cpu_infer": cpu_infer,
    }
    env = {
        **os.environ,
        "FORCE_TORCHRUN": "1",
        "NPROC_PER_NODE": str(procs),
        "KT_FT_RUN_REPORT": str(report),
        "PATH": f"{cli.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    if not share:
        env["KT_FT_SHARED_DIR"] = "off"
    log = work / f"run{tag}.log"
    with open(log, "w") as f:
        rc = subprocess.call(
            [str(cli), "train", str(RECIPE), *(f"{k}={v}" for k, v in args.items())],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )
    if rc != 0:
        raise SystemExit(f"{procs} processes: llamafactory-cli train failed (rc {rc}); see {log}")
    records = [json.loads(p.read_text()) for p in sorted(report.glob("rank*.json"))]
    if len(records) != procs:
        raise SystemExit(f"{procs} processes: {len(records)} memory reports in {report}; see {log}")
    return sorted(records, key=lambda r: r["rank"])


def table(results: dict[str, list[dict]]) -> str:
    head = (
        "| procs | rank | Rss MiB | Pss MiB | Private MiB | expert map Rss / Pss MiB | "
        "total Pss MiB | expert weights MiB |"
    )
    lines = [head, "|" + "---|" * 8]
    for procs, records in results.items():
        total = sum(r["process"]["Pss"] for r in records)
        for r in records:
            p, m = r["process"], r["expert_mapping"]
            mapping = f"{m['Rss'] / MiB:,.0f} / {m['Pss'] / MiB:,.0f}" if m["count"] else "- (private)"
            lines.append(
                f"| {procs} | {r['rank']} | {p['Rss'] / MiB:,.0f} | {p['Pss'] / MiB:,.0f} | "
                f"{p['Private'] / MiB:,.0f} | {mapping} | "
                f"{total / MiB:,.0f} | {r['expert_bytes'] / MiB:,.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--work", type=Path, default=Path("/tmp/kt-ft-ddp-memory"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--private",
        type=int,
        nargs="*",
        default=[],
        help="also these process counts with KT_FT_SHARED_DIR=off",
    )
    ap.add_argument("--cpu-infer", type=int, default=4, help="machine's expert threads, split between ranks")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    demo = build_model(a.work, BIG_EXPERTS)
    results = {f"{n}": run(demo, a.work, n, a.steps, a.cpu_infer) for n in a.procs}
    results |= {f"{n} (private)": run(demo, a.work, n, a.steps, a.cpu_infer, share=False) for n in a.private}
    print(table(results))


if __name__ == "__main__":
    main()
