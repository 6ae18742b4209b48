"""`kt-ft bench --parts placement`: tokens/s against the GPU memory cap, per expert placement.

Systems, each trained in its own process by ``step.worker`` on one random model of the
preset (``--layers`` of its decoder layers, default 4; the whole ``tiny`` model), one sequence
of ``--seq`` tokens a step, LoRA r 8, gradient checkpointing, AdamW, best step after a warm-up:

- ``kt-ft[cpu]``: every routed expert on the CPU (cap-independent: one run);
- ``kt-ft[cpu kt-kernel]``: the same with kt-kernel's CPU kernel, where it runs and the bench's
  backend is another one (the "kt-kernel only" baseline of issue 8: KTransformers' placement);
- ``kt-ft[auto]``: ``placement: auto`` at each cap (the planner's split: resident / streamed / CPU);
- ``kt-ft[stream]``: every expert streamed (``stream: all``; cap-independent: its buffers are
  two layers' experts whatever the depth, so one run);
- ``peft-gpu``: transformers + PEFT all on the GPU (cap-independent: one run; its peak memory
  says which caps it fits).

The caps are for the FULL model: the routed experts' budget is the cap minus ``rules plan``'s
estimate of everything else for the full model, and the planner counts each benchmarked layer's
resident experts real layers / layers times (the stream buffers and the activation reserve,
a layer or two whatever the depth, once: ``placement/planner.py`` ``layer_scale``). Each kt-ft
record carries the cost model's predicted step time beside the measured one (rates:
``placement/measure.py``'s cache or a measurement; on a CPU-only machine the "GPU" is the
CPU device, its rates measured there, so the smoke run exercises the resident path). ``--plot FILE.png`` draws tokens/s against the cap (matplotlib).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kt_ft.integrations.bench.models import MODEL_CONFIGS, StepRecord, build_model_dir
from kt_ft.integrations.bench.placement_system import PLACEMENTS, expert_budget
from kt_ft.integrations.bench.step import run_one

DEFAULT_CAPS = (8.0, 16.0, 24.0, 40.0, 80.0)


def run_placement(
    preset: str,
    layers: int | None,
    seq: int,
    caps: list[float],
    backend: str,
    threads: int,
    steps: int,
    timeout_s: int = 900,
    all_gpu: bool = True,
    kt_kernel: bool = False,
    placements: tuple[str, ...] | list[str] = PLACEMENTS,
    worker_flags: tuple[str, ...] = (),
) -> list[StepRecord]:
    """Every placement system at every cap (module doc), each in a subprocess; failures printed.
    ``all_gpu``: False leaves out the transformers + PEFT run (``--systems`` without peft-gpu);
    ``kt_kernel``: add the all-CPU run with kt-kernel's kernel (when ``backend`` is another);
    ``placements``: the kt-ft placements to run (``PLACEMENTS`` by default); ``worker_flags``: added to
    every worker's command (``step.worker_flags``: profile, trace, replan)."""
    from tqdm import tqdm

    n_layers = layers or min(MODEL_CONFIGS[preset][1]["num_hidden_layers"], 4)
    jobs: list[tuple[str, str | None, float | None, str]] = []
    if "cpu" in placements:
        jobs.append(("kt-ft", "cpu", None, backend))
        if kt_kernel and backend != "kt-kernel":
            jobs.append(("kt-ft", "cpu", None, "kt-kernel"))
    # auto and stream with kt_backend auto, as a recipe that names none: the fastest CPU backend
    # here (kt-kernel on an AMX Xeon) computes auto's CPU share
    if "auto" in placements:
        jobs += [("kt-ft", "auto", c, "auto") for c in caps]
    if "stream" in placements:
        jobs.append(("kt-ft", "stream", None, "auto"))
    if all_gpu:
        jobs.append(("peft-gpu", None, None, backend))
    records: list[StepRecord] = []
    with tempfile.TemporaryDirectory(prefix="kt-ft-bench-") as tmp:
        model_dir, _ = build_model_dir(preset, n_layers, Path(tmp) / "model")
        for system, placement, cap, job_backend in tqdm(
            jobs, desc=f"placement bench {preset} x{n_layers} layers", unit="run"
        ):
            out = Path(tmp) / f"{system}-{placement}-{cap}-{job_backend}.json"
            cmd = [sys.executable, "-m", "kt_ft.integrations.bench.step", "--system", system, "--backend", job_backend,
                   "--model", str(model_dir), "--preset", preset, "--seq", str(seq), "--threads", str(threads),
                   "--steps", str(steps), "--out", str(out), *worker_flags]  # fmt: skip
            if placement is not None:
                cmd += ["--placement", placement]
            if cap is not None:
                budget = expert_budget(preset, cap, seq)
                cmd += ["--gpu-cap-gib", f"{cap:g}", "--expert-budget", str(budget)]
            label = (
                f"{system}[{placement}] cap {cap:g} GiB"
                if cap is not None
                else f"{system} {placement or ''} {job_backend if system == 'kt-ft' else ''}".strip()
            )
            rec = run_one(cmd, out, label, timeout_s)
            if rec is None:
                continue
            rec.kind = "placement"
            records.append(rec)
    print_placement_table(records)
    return records


def print_placement_table(records: list[StepRecord]) -> None:
    if not records:
        return
    r0 = records[0]
    print(
        f"\nplacement bench, {r0.preset}: {r0.layers} of {r0.real_layers} layers, seq {r0.tokens}; caps are for "
        "the full model (kt_ft/integrations/bench/placement.py)"
    )
    print(
        f"{'system':<18}{'cap GiB':>9}{'predicted ms':>14}{'measured ms':>13}{'tok/s':>10}{'peak GPU':>12}  note"
    )
    for r in records:
        cap = f"{r.cap_gib:g}" if r.cap_gib is not None else "-"
        pred = f"{r.predicted_s * 1e3:.1f}" if r.predicted_s is not None else "-"
        gpu = f"{r.peak_gpu_bytes / 2**30:.2f} GiB" if r.peak_gpu_bytes is not None else "-"
        print(f"{r.name:<18}{cap:>9}{pred:>14}{r.seconds * 1e3:>13.1f}{r.tok_s:>10,.0f}{gpu:>12}  {r.note}")


def plot_placement(records: list[StepRecord], path: str) -> bool:
    """tokens/s against the cap: a line per placement (measured solid, predicted dashed), the
    cap-independent systems as horizontal lines. False (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed here (pip install matplotlib); no plot written")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = sorted({r.cap_gib for r in records if r.cap_gib is not None})
    by: dict[str, list[StepRecord]] = {}
    for r in records:
        by.setdefault(r.name, []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (name, rs) in enumerate(by.items()):
        color = colors[n % len(colors)]
        swept = sorted((r for r in rs if r.cap_gib is not None), key=lambda r: r.cap_gib)
        if swept:
            x, y = [r.cap_gib for r in swept], [r.tok_s for r in swept]
            ax.plot(x, y, "o-", color=color, label=f"{name} measured")
            pred = [(r.cap_gib, r.tokens / r.predicted_s) for r in swept if r.predicted_s]
            if pred:
                ax.plot(*zip(*pred), "x--", color=color, label=f"{name} predicted")
        for r in (r for r in rs if r.cap_gib is None):
            peak = f", peak GPU {r.peak_gpu_bytes / 2**30:.1f} GiB" if r.peak_gpu_bytes is not None else ""
            ax.axhline(r.tok_s, linestyle=":", color=color, label=f"{name} (any cap){peak}")
    ax.set_xlabel("GPU memory cap for the full model (GiB)")
    ax.set_ylabel("tokens/s")
    r0 = records[0]
    ax.set_title(f"{r0.preset}: {r0.layers} of {r0.real_layers} layers, seq {r0.tokens}")
    if caps:
        if caps[-1] / caps[0] > 20:
            ax.set_xscale("log")
        ax.set_xticks(caps, [f"{c:g}" for c in caps])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return True
