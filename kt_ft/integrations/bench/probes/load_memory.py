"""Peak RSS while loading a MoE checkpoint the way kt-ft does, per loading method.

    python -m kt_ft.integrations.bench.probes.load_memory [--dir /tmp/kt-load-model] [--layers 6] [--hidden 1024]
        [--moe-intermediate 768] [--experts 64] [--methods transformers,kt-ft,...]

Builds (once, reused when ``--dir`` holds it) a random bf16 qwen3_moe checkpoint, written by
transformers' ``save_pretrained`` (per-expert keys, 500 MB shards), then loads it in a fresh
subprocess per method and prints one JSON line per method and a table:

* ``transformers``: kt-ft's device map before this change, CPU machine (``{"": "cpu"}``: what
  LLaMA-Factory does without CUDA): transformers reads everything, experts included;
* ``transformers-experts``: the same with every non-expert module on ``meta``: only the routed
  experts are read into RAM, as on the GPU path (where the rest goes to the GPU);
* ``kt-ft``, ``kt-ft-experts``: the same two maps, routed experts read by kt-ft
  (``kt_ft.runtime.loading.load_planned``: meta in ``from_pretrained``, then ``ExpertStream.fill``).

Measured in the child: after imports and a warm-up load of a tiny model (lazy initialisations
not counted), VmHWM is reset (``/proc/self/clear_refs``); ``peak`` = VmHWM after loading - VmRSS
before; ``ru_maxrss`` growth too (it cannot be reset, and Linux carries it over fork and exec: this
parent stays small and builds the checkpoint in a child of its own);
``anon`` / ``file``: growth of RssAnon (private copies) and RssFile (file pages mapped, e.g. by
safetensors' mmap) from before to after loading. ``expert_bytes``: the routed experts' bytes in
the loaded model; ``other_bytes``: the rest that is on the CPU.

``--probe METHOD DIR`` runs one child (used by tests/test_load_memory.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2**20
METHODS = ("transformers", "transformers-experts", "kt-ft", "kt-ft-experts")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def drop_page_cache(model_dir: str | Path) -> None:
    """Start every method from a cold page cache (a previous run left the files cached; cached
    pages are mapped by fault-around when a neighbour is touched, which changes RssFile)."""
    for f in Path(model_dir).glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def probe(method: str, model_dir: str, warmup_dir: str | None) -> dict:
    """Load ``model_dir`` with ``method`` in this process and measure (see module doc)."""
    import resource
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # kt-ft only in the measuring child: the parent stays small (ru_maxrss carries over fork and exec)
    from kt_ft.plan.builtin import resolve_rule_path  # why: the child alone
    from kt_ft.plan.family import family_of  # why: the child alone
    from kt_ft.plan.loader import load_rules  # why: the child alone
    from kt_ft.runtime import loading  # why: the child alone

    if warmup_dir:
        AutoModelForCausalLM.from_pretrained(warmup_dir, dtype=torch.bfloat16, device_map={"": "cpu"})
    drop_page_cache(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    family = family_of(config)
    device_map, plan = loading.planned_device_map(
        config, load_rules(resolve_rule_path(family.builtin_rule)), family, "auto", 1, "cpu"
    )
    experts = [e.name for e in plan.experts]
    if method.endswith("-experts"):
        device_map = loading.KTDeviceMap({"": "meta", **dict.fromkeys(experts, "cpu")})
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    rss0, anon0, file0 = _status("VmRSS:"), _status("RssAnon:"), _status("RssFile:")
    maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if method.startswith("transformers"):  # transformers reads every weight it is given, experts too
        model = AutoModelForCausalLM.from_pretrained(model_dir, device_map=device_map, dtype=torch.bfloat16)
    else:  # the routed experts read by kt-ft (``loading.plan_expert_reader``)
        model = loading.load_planned(model_dir, device_map, plan, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    in_experts = {n for n, _ in model.named_parameters() if n.rpartition(".")[0] in experts}
    cpu = {n: p for n, p in model.named_parameters() if p.device.type == "cpu"}
    return {
        "method": method,
        "seconds": round(seconds, 2),
        "peak": _status("VmHWM:") - rss0,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - maxrss0,
        "anon": _status("RssAnon:") - anon0,
        "file": _status("RssFile:") - file0,
        "expert_bytes": sum(p.numel() * p.element_size() for n, p in cpu.items() if n in in_experts),
        "other_bytes": sum(p.numel() * p.element_size() for n, p in cpu.items() if n not in in_experts),
        "expert_devices": sorted({str(p.device) for n, p in model.named_parameters() if n in in_experts}),
    }


def build(
    model_dir: Path, layers: int, hidden: int, moe_intermediate: int, experts: int, vocab: int = 4096
) -> None:
    """A random bf16 qwen3_moe checkpoint (transformers' own save layout), unless already there."""
    if (model_dir / "config.json").is_file():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=vocab, hidden_size=hidden, moe_intermediate_size=moe_intermediate,
        intermediate_size=4 * moe_intermediate, num_experts=experts, num_experts_per_tok=8, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, tie_word_embeddings=False,
    )  # fmt: skip
    # on meta, then plain uniform_ per parameter: HF's own init (and bf16 normal_) take ~20x longer (only
    # the weights' bytes matter here; non-persistent buffers are not saved)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05, generator=gen)
    model.save_pretrained(model_dir, max_shard_size="500MB")


def run_probe(method: str, model_dir: Path, warmup_dir: Path | None) -> dict:
    """``probe`` in a fresh subprocess (this module, ``--probe``); kt_ft from this checkout."""
    root = Path(__file__).resolve().parents[4]  # the checkout: kt_ft/integrations/bench/probes/ is 4 below
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, __file__, "--probe", method, str(model_dir)]
    if warmup_dir:
        cmd += ["--warmup", str(warmup_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "kt-load-model"))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--probe", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--warmup", help=argparse.SUPPRESS)
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe:
        print(json.dumps(probe(a.probe[0], a.probe[1], a.warmup)))
        return
    model_dir, warmup_dir = Path(a.dir), Path(a.dir + "-warmup")
    if a.build_only:
        build(model_dir, a.layers, a.hidden, a.moe_intermediate, a.experts)
        build(warmup_dir, 1, 64, 32, 8, vocab=128)
        return
    sizes = [
        "--layers",
        a.layers,
        "--hidden",
        a.hidden,
        "--moe-intermediate",
        a.moe_intermediate,
        "--experts",
        a.experts,
    ]
    subprocess.run([sys.executable, __file__, "--build-only", "--dir", a.dir, *map(str, sizes)], check=True)
    rows = []
    for method in a.methods.split(","):
        r = run_probe(method, model_dir, warmup_dir)
        print(json.dumps(r), flush=True)
        rows.append(r)
    print(f"\n{'method':22} {'experts':>9} {'other':>9} {'peak':>9} {'ru_maxrss':>9} {'anon':>9} {'file':>9} "
          f"{'peak/(experts+other)':>21} {'s':>6}")  # fmt: skip
    for r in rows:
        ratio = r["peak"] / (r["expert_bytes"] + r["other_bytes"])
        print(f"{r['method']:22} " + " ".join(f"{r[k] / MiB:8.0f}M" for k in
              ("expert_bytes", "other_bytes", "peak", "ru_maxrss", "anon", "file")) + f" {ratio:21.2f} {r['seconds']:6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
