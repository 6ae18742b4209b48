"""`kt-ft bench --step`: one full training step (forward, backward, AdamW) of a whole model,
kt-ft against the alternatives, each system in its own process (own peak GPU memory and RSS).

Systems, all on the same random-weight model (a preset's real layer shapes, ``--layers`` of
them, bf16, saved once to a temporary directory), LoRA r 8 / alpha 16 on attention
(q, k, v, o) and on the routed experts, gradient checkpointing on (LLaMA-Factory's default),
one sequence of ``--seq`` tokens per step, fused AdamW (the HF Trainer's default optimizer with
torch >= 2.8; runs before 2026-12-03 used torch's unfused default):

- ``kt-ft[<backend>]``: routed experts loaded straight into CPU RAM and computed there by the
  backend (their LoRA trained by kt-ft), everything else on the GPU with PEFT.
- ``peft-gpu``: transformers + PEFT all on the GPU; expert LoRA through PEFT's
  ``target_parameters`` (the installed PEFT's reach for fused experts).
- ``offload``: transformers with accelerate's CPU offload (``device_map="auto"``) under a GPU
  memory cap, LoRA on attention only: PEFT's ``target_parameters`` LoRA fails on offloaded
  (meta) expert weights (PEFT 0.21: "unsupported scalarType" in its autocast guard), so this
  system does less work than the others. The cap (default 24 GiB) is for the full model: the
  share of its routed experts that fits beside everything else stays on the GPU, and the same
  share of the benchmarked layers' experts does, the rest is offloaded.

With two or more layer counts (``--layers 2,4``) every system runs at each, and a line fitted
through the two largest (time and peak GPU memory are affine in the layer count: fixed
embeddings and head, the same work per layer) extrapolates to the real model's layer count.

Without CUDA (CI, laptops) the GPU systems run on the CPU and ``offload`` is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from kt_ft.integrations.bench.models import LORA_ALPHA, LORA_RANK, MODEL_CONFIGS, StepRecord, build_model_dir
from kt_ft.integrations.bench.placement_system import Placement, expert_budget, split_text
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.family import family_of
from kt_ft.plan.loader import load_rules
from kt_ft.runtime.core import KTConfig, apply, plan_for
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.loading import load_planned, planned_device_map
from kt_ft.runtime.replan import CALIBRATE_AFTER, Replanner

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SYSTEMS = ("kt-ft", "peft-gpu", "offload")  # a worker's --system
# the step part's --systems: also kt-ft with every expert streamed (a kt-ft worker, --placement stream)
# and kt-ft with ``placement: auto`` under the offload run's GPU memory cap (--placement auto)
STEP_SYSTEMS = ("kt-ft", "kt-ft-stream", "kt-ft-auto", "peft-gpu", "offload")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _load_kt(model_dir: str, device, backend: str, threads: int, seq: int, placement=None):
    """kt-ft's model; ``placement``: None (the family's rule: every expert on the CPU) or a
    ``placement_system.Placement`` (the rule it writes, the planner's budget and rates)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    family = family_of(config)
    rule_path = resolve_rule_path(family.builtin_rule) if placement is None else placement.rule_file(family)
    rules = load_rules(rule_path)
    # routed experts read by kt-ft straight into CPU RAM (one copy), the rest to the device
    device_map, load_plan = planned_device_map(config, rules, family, backend, threads, str(device))
    model = load_planned(model_dir, device_map, load_plan, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=ATTN))
    # the product's path (kt_ft.apply), with the bench's own split for a placement: the planner
    # budget of the full model scaled to the benchmarked layers (placement_system.Placement)
    config = KTConfig(
        rule=rule_path,
        rank=LORA_RANK,
        alpha=LORA_ALPHA,
        backend=backend,
        threads=threads,
        chunk_size=seq,
        seed=0,
    )
    plan, _ = plan_for(model, config)
    note = ""
    if placement is not None:
        note = placement.apply(model, plan, seq) + "; "
    auto = placement.ctx if placement is not None else None
    summary = apply(model, config, plan=plan, planned_auto=auto, trainable=False).summary
    model.to(device)  # what the HF Trainer does; KTExperts stay on the CPU
    return model, f"{note}backend {summary.backend}, {summary.threads} threads"


def _peft_config(with_experts: bool):
    from peft import LoraConfig

    extra = {"target_parameters": EXPERT_PARAMS} if with_experts else {}
    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=ATTN, **extra)


def _load_peft(model_dir: str, device, device_map, max_memory=None, experts: bool = True):
    """transformers + PEFT with expert LoRA where the installed PEFT reaches fused experts."""
    import warnings

    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, device_map=device_map, max_memory=max_memory
    )
    if not experts:
        return get_peft_model(model, _peft_config(False)), "LoRA on attention only"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns "unsupported layer type" for fused experts
            return get_peft_model(
                model, _peft_config(True)
            ), "LoRA on attention + experts (target_parameters)"
    except (TypeError, ValueError) as e:  # a PEFT without target_parameters for these experts
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, device_map=device_map, max_memory=max_memory
        )
        return get_peft_model(model, _peft_config(False)), f"LoRA on attention only ({e})"


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def expert_share_on_gpu(preset: str, cap_bytes: float) -> float:
    """The share of the FULL model's routed-experts bytes that fits on the GPU under ``cap_bytes``
    once everything else (embeddings, head, attention, dense and shared MLPs) is there."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, cfg = MODEL_CONFIGS[preset]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, **cfg), dtype=torch.bfloat16
        )
    experts = sum(_param_bytes(m) for n, m in model.named_modules() if n.endswith("mlp.experts"))
    return min(1.0, max(0.0, (cap_bytes - (_param_bytes(model) - experts)) / experts)) if experts else 1.0


def offload_device_map(model_dir: str, keep_share: float) -> tuple[dict[str, int | str], int, int]:
    """accelerate's offload map: everything trainable (attention, its LoRA, embeddings, head) on
    GPU 0, the first ``keep_share`` of the routed-experts modules too, the rest offloaded to the
    CPU (accelerate copies them in at each forward). ``device_map="auto"`` would offload whole
    decoder layers, LoRA included, and PEFT cannot train offloaded (meta) weights.
    Returns (device map, offloaded modules, all experts modules)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    names = [n for n, _ in model.named_modules() if n.endswith("mlp.experts")]
    keep = round(keep_share * len(names))
    device_map: dict[str, int | str] = {"": 0}
    for name in names[keep:]:
        device_map[name] = "cpu"
    return device_map, len(names) - keep, len(names)


def _train_step(model, ids, opt, cuda: bool):
    """One optimizer step on ``ids`` (labels = inputs); returns the loss once the device is done."""
    import torch

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return loss


def _profile_step(model, ids, opt, path: Path, cuda: bool, trace: bool) -> None:
    """``--profile DIR``: one training step under torch.profiler, its op table (by self CPU time and by
    device time) written to ``path``; ``trace``: its timeline too."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        _train_step(model, ids, opt, cuda)
    table = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    if trace:  # the timeline too (chrome://tracing, Perfetto)
        prof.export_chrome_trace(str(path.with_suffix(".trace.json")))
    text = table.table(sort_by="self_cpu_time_total", row_limit=40)
    if cuda:
        text += "\n" + table.table(sort_by="self_cuda_time_total", row_limit=25)
    path.write_text(text)


def worker(args: argparse.Namespace) -> StepRecord:
    """Load one system, train ``warmup + steps`` steps, report the best step time."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    torch.set_num_threads(args.threads)
    name = args.system
    placement = None
    if args.system == "kt-ft" and args.placement is not None:
        placement = Placement(
            args.placement, args.preset, args.gpu_cap_gib, args.threads, args.backend, args.expert_budget
        )
    if args.system == "kt-ft":
        model, note = _load_kt(args.model, device, args.backend, args.threads, args.seq, placement)
        name = f"kt-ft[{args.backend}]" if placement is None else f"kt-ft[{args.placement}]"
        if args.placement == "cpu" and args.backend == "kt-kernel":
            name = "kt-ft[cpu kt-kernel]"  # the all-CPU baseline beside the bench's own backend
    elif args.system == "peft-gpu":
        model, note = _load_peft(args.model, device, {"": device})
        name = "peft-gpu" if cuda else "peft-cpu"  # without CUDA the "all on the GPU" system runs on the CPU
    else:
        share = expert_share_on_gpu(args.preset, args.gpu_cap_gib * 2**30)
        device_map, n_off, n = offload_device_map(args.model, share)
        model, note = _load_peft(args.model, device, device_map, experts=False)
        note += (
            f"; a {args.gpu_cap_gib:g} GiB cap on the full model keeps {share:.0%} of its experts on the GPU:"
            f" {n_off} of {n} experts modules offloaded here"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: what the HF Trainer uses by default with torch >= 2.8 (optim adamw_torch_fused); the
    # unfused default of torch.optim.AdamW loops over tensors, ~4x slower on kt-ft's CPU expert LoRA
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, args.seq), generator=gen).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    runners = [m.runner for m in model.modules() if isinstance(m, KTExperts)]
    replanner, warmup = None, args.warmup
    # --no-replan: time the planner's first split as it is (no calibration, no trial)
    if args.replan and placement is not None and placement.ctx is not None and placement.ctx.rates.has_gpu:
        # as a run does (``placement/runtime.py``): after a few steps the CPU op's rate in the run
        # replaces the measured one when they differ; those steps are warm-up, plus one for a new split
        replanner = Replanner(placement.ctx, every=0, threshold=1.0)
        warmup = max(args.warmup, CALIBRATE_AFTER + 1)
    # the model's stream scheduler (one per model), whose counters say what crossed the link
    sched = next((m.scheduler for m in model.modules() if isinstance(m, KTExperts) and m.streamed), None)

    def link_totals() -> tuple[int, int, int]:
        st = sched.stats() if sched is not None else {"bytes_streamed": 0, "copies": 0, "hits": 0}
        return st["bytes_streamed"], st["copies"], st["hits"]

    times, losses, busy, streamed = [], [], [], []
    step = 0
    while step < warmup + args.steps:
        if replanner is not None and replanner.trying and step >= warmup:
            warmup = step + 1  # the auto split is still being tried (``Replanner``): still warm-up
        busy0, link0 = sum(r.busy_s for r in runners), link_totals()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = _train_step(model, ids, opt, cuda)
        times.append(time.perf_counter() - t0)
        busy.append(sum(r.busy_s for r in runners) - busy0)
        streamed.append(tuple(b - a for a, b in zip(link0, link_totals())))
        losses.append(float(loss))
        if replanner is not None and replanner.step(step + 1):
            warmup = max(warmup, step + 2)  # the next step settles the new split: not timed
        step += 1
    if replanner is not None and replanner.last_choice is not None:
        choice = replanner.last_choice  # the split the timed steps ran
        placement.predicted_s = choice.prediction.step_s
        note += f"; re-planned in the run: {split_text(choice, runners[0].base.num_experts)}"
    if replanner is not None and replanner.trial_note:
        note += f"; trial: {replanner.trial_note}"
    best = min(times[warmup:])
    if args.profile:  # one more step under the profiler: where the time goes (not part of the figures)
        stem = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{name}-{args.gpu_cap_gib or 0:g}")
        _profile_step(model, ids, opt, Path(args.profile) / f"{stem}.txt", cuda, args.trace)
    i = times.index(best)
    if runners:  # how much of the step the CPU experts take: what overlapping could hide is the rest
        note += f"; CPU expert op {busy[i] * 1e3:.0f} ms of the step ({busy[i] / best:.0%})"
    if sched is not None:  # what the link carried in that step (a reuse: a layer's weights still there)
        nbytes, copies, hits = streamed[i]
        note += f"; streamed {nbytes / 1e9:.2f} GB in the step ({copies} layer copies, {hits} reuses)"
    rec = StepRecord(
        name=name,
        kind="step",
        preset=args.preset,
        tokens=args.seq,
        seconds=best,
        tok_s=args.seq / best,
        layers=model.config.num_hidden_layers,
        real_layers=MODEL_CONFIGS[args.preset][1]["num_hidden_layers"],
        peak_gpu_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        peak_rss_bytes=_peak_rss(),
        losses=losses,
        note=note,
    )
    if placement is not None:  # (the placement part marks its records "placement" itself)
        rec.predicted_s = placement.predicted_s
        rec.cap_gib = args.gpu_cap_gib if args.expert_budget is not None else None
    return rec


def run_step(
    preset: str,
    layers: list[int] | None,
    seq: int,
    systems: list[str],
    backends: list[str],
    threads: int,
    steps: int,
    gpu_cap_gib: float,
    timeout_s: int = 900,
    worker_flags: tuple[str, ...] = (),
) -> list[StepRecord]:
    """Every system on one saved random model, each in a subprocess; failures are printed.
    ``worker_flags``: added to every worker's command (``worker_flags``: profile, trace, replan)."""
    import torch

    _, cfg = MODEL_CONFIGS[preset]
    layers = sorted(set(layers or [min(cfg["num_hidden_layers"], 4)]))
    cuda = torch.cuda.is_available()
    jobs = []
    for s in systems:
        if s == "offload" and not cuda:
            print("skipping offload: accelerate CPU offload needs a CUDA GPU")
        elif s == "kt-ft":
            jobs.extend(("kt-ft", b, None) for b in backends)
        elif s == "kt-ft-stream":  # every expert streamed: the CPU backend does not matter
            jobs.append(("kt-ft", backends[0] if backends else "auto", "stream"))
        elif s == "kt-ft-auto":  # the planner's split under offload's cap; CPU share: kt_backend auto
            jobs.append(("kt-ft", "auto", "auto"))
        else:
            jobs.append((s, "", None))
    records: list[StepRecord] = []
    for n_layers in layers:
        records += _run_systems(
            preset, n_layers, seq, jobs, threads, steps, gpu_cap_gib, timeout_s, worker_flags
        )
    if len(layers) > 1:
        records += extrapolate(records, layers[-2], layers[-1])
        print_step_table([r for r in records if r.kind == "step-extrapolated"])
    return records


def extrapolate(records: list[StepRecord], l1: int, l2: int) -> list[StepRecord]:
    """Per system, the line through its l1- and l2-layer runs evaluated at the real layer count."""
    out = []
    by = {(r.name, r.layers): r for r in records if r.kind == "step"}
    for name in dict.fromkeys(r.name for r in records if r.kind == "step"):
        a, b = by.get((name, l1)), by.get((name, l2))
        if a is None or b is None:
            continue
        n = b.real_layers

        def at(va, vb, n=n):
            return va + (vb - va) * (n - l1) / (l2 - l1)

        sec = at(a.seconds, b.seconds)
        gpu = None if a.peak_gpu_bytes is None else int(at(a.peak_gpu_bytes, b.peak_gpu_bytes))
        out.append(
            StepRecord(name, "step-extrapolated", b.preset, b.tokens, sec, b.tokens / sec, n, n, gpu,
                       int(at(a.peak_rss_bytes, b.peak_rss_bytes)), [], f"fitted through {l1} and {l2} layers")
        )  # fmt: skip
    return out


def worker_flags(profile: str | None = None, trace: bool = False, replan: bool = True) -> tuple[str, ...]:
    """The worker's own flags for ``kt-ft bench``'s ``--profile DIR``, ``--trace`` and ``--no-replan``
    (the step and placement parts run every system in a worker subprocess: ``main``)."""
    return (
        *(("--profile", str(profile)) if profile else ()),
        *(("--trace",) if trace else ()),
        *(() if replan else ("--no-replan",)),
    )


def _run_systems(
    preset, n_layers, seq, jobs, threads, steps, gpu_cap_gib, timeout_s, flags=()
) -> list[StepRecord]:
    from tqdm import tqdm

    records: list[StepRecord] = []
    with tempfile.TemporaryDirectory(prefix="kt-ft-bench-") as tmp:
        model_dir, share = build_model_dir(preset, n_layers, Path(tmp) / "model")
        for system, backend, placement in tqdm(
            jobs, desc=f"step bench {preset} x{n_layers} layers", unit="system"
        ):
            out = Path(tmp) / f"{system}-{backend}-{placement}.json"
            cmd = [sys.executable, "-m", "kt_ft.integrations.bench.step", "--system", system, "--backend", backend or "auto",
                   "--model", str(model_dir), "--preset", preset, "--seq", str(seq), "--threads", str(threads),
                   "--steps", str(steps), "--gpu-cap-gib", f"{gpu_cap_gib:g}", "--out", str(out), *flags]  # fmt: skip
            if placement is not None:
                cmd += ["--placement", placement]
            if placement == "auto":  # the experts' share of the cap, for the full model (placement_system.py)
                cmd += ["--expert-budget", str(expert_budget(preset, gpu_cap_gib, seq))]
            rec = run_one(cmd, out, f"{system} {placement or backend}", timeout_s)
            if rec is not None:
                records.append(rec)
    print_step_table(records, share)
    return records


def run_one(cmd: list[str], out: Path, label: str, timeout_s: float) -> StepRecord | None:
    """One system's run (``cmd``, a ``kt_ft.integrations.bench.step`` subprocess writing ``out``); a timeout
    or failure is printed with the run's last lines and gives None."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"{label}: timed out after {timeout_s} s")
        return None
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        print(f"{label}: failed (exit {proc.returncode}):\n{tail}")
        return None
    rec = StepRecord(**json.loads(out.read_text()))
    # each run's figures as soon as it ends: a bench killed later (a time limit) keeps them
    from tqdm import tqdm

    gpu = f"{rec.peak_gpu_bytes / 2**30:.2f} GiB" if rec.peak_gpu_bytes is not None else "-"
    pred = f", predicted {rec.predicted_s * 1e3:.1f} ms" if rec.predicted_s is not None else ""
    tqdm.write(
        f"{label}: {rec.seconds * 1e3:.1f} ms ({rec.tok_s:,.0f} tok/s{pred}), peak GPU {gpu}; {rec.note}"
    )
    return rec


def print_step_table(records: list[StepRecord], share: float | None = None) -> None:
    if not records:
        return
    r0 = records[0]
    kind = "extrapolated " if r0.kind == "step-extrapolated" else ""
    print(
        f"\n{kind}full training step, {r0.preset}: {r0.layers} of {r0.real_layers} layers"
        + (f" ({share:.1%} of the parameters)" if share else "")
        + f", seq {r0.tokens}, LoRA r {LORA_RANK} on attention + experts, gradient checkpointing, AdamW"
    )
    print(f"{'system':<22}{'step ms':>10}{'tok/s':>10}{'peak GPU':>12}{'peak RSS':>12}  note")
    for r in records:
        gpu = f"{r.peak_gpu_bytes / 2**30:.2f} GiB" if r.peak_gpu_bytes is not None else "-"
        print(
            f"{r.name:<22}{r.seconds * 1e3:>10.1f}{r.tok_s:>10,.0f}{gpu:>12}"
            f"{r.peak_rss_bytes / 2**30:>8.2f} GiB  {r.note}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="one system of the full-step benchmark (run by kt-ft bench --step)"
    )
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--model", required=True)
    p.add_argument("--preset", choices=list(MODEL_CONFIGS), required=True)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gpu-cap-gib", type=float, default=24.0)
    p.add_argument("--placement", choices=["cpu", "auto", "stream"], default=None,
                   help="kt-ft: placement bench system (kt_ft/integrations/bench/placement.py); default: the family rule")  # fmt: skip
    p.add_argument(
        "--expert-budget", type=int, default=None, help="placement auto: the routed experts' GPU bytes"
    )
    p.add_argument(
        "--profile", default=None, help="DIR: one more step under torch.profiler, its op tables there"
    )
    p.add_argument("--trace", action="store_true", help="with --profile: the step's timeline too")
    p.add_argument("--no-replan", dest="replan", action="store_false",
                   help="placement auto: time the planner's first split (no calibration, no trial)")  # fmt: skip
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rec = worker(args)
    Path(args.out).write_text(json.dumps(asdict(rec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
