"""`kt-ft bench --parts e2e`: the report: a line per finished run, the table (with each streaming
run's link bound, the medians over rounds and the kt-ft systems' loss agreement) and ``--json``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

from kt_ft.integrations.bench.e2e_monitor import GIB
from kt_ft.integrations.bench.e2e_run import E2ERecord


def one_line(r: E2ERecord) -> str:
    tok = f"{r.tok_s:,.0f} tok/s" if r.tok_s else "no rate"
    gpu = f", GPU peak {r.gpu_peak_bytes / GIB:.1f} GiB" if r.gpu_peak_bytes else ""
    load = f" (before training {r.host_peak_load_bytes / GIB:.1f})" if r.host_peak_load_bytes else ""
    op = f", CPU op {r.cpu_op_micro_s * 1e3:.0f} ms a micro-batch" if r.cpu_op_micro_s else ""
    util = f", GPU busy {r.gpu_util:.0f}%" if r.gpu_util is not None else ""
    if r.link_bound_tok_s:
        reached = f", {r.tok_s / r.link_bound_tok_s:.0%} of it" if r.tok_s else ""
        util += f", link bound {r.link_bound_tok_s:,.0f} tok/s{reached}"
    host = f"; {r.host_line}" if r.host_line else ""
    return (
        f"rc {r.rc}, {tok}{gpu}{util}, host peak {r.host_peak_bytes / GIB:.1f} GiB{load}{op}, {r.seconds:.0f} s "
        f"{r.note}{host}"
    )


def write_json(path: str, records: list[E2ERecord], cutoff_len: int, grad_accum: int, threads: int) -> None:
    import platform

    import torch

    meta = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "threads": threads,
            "cutoff_len": cutoff_len, "gradient_accumulation_steps": grad_accum}  # fmt: skip
    if torch.cuda.is_available() and shutil.which("nvidia-smi"):  # the driver's word: no CUDA context here
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        meta["gpu"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else None
    for mod in ("transformers", "peft", "llamafactory"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (absent or broken: the file says so)
            meta[mod] = None
    rows = []
    for r in records:
        row = asdict(r)
        row["measured_micro_s"] = r.measured_micro_s
        rows.append(row)
    Path(path).write_text(json.dumps({"meta": meta, "records": rows}, indent=1))


def loss_agreement(records: list[E2ERecord]) -> tuple[str, float, int] | None:
    """(reference system, largest relative loss difference, steps compared) of the kt-ft systems'
    losses step by step against the first kt-ft system that logged any; None: fewer than two.

    Every kt-ft placement trains the same adapter from the same initialisation, so past the first
    step too their losses differ only by the placements' arithmetic (bf16 on the GPU, the CPU op's
    order of summation), amplified a little by the optimizer; a cache that kept an old LoRA, or a
    placement that trains something else, shows here as a difference that grows with the steps."""
    kt = [r for r in records if r.system.startswith("kt-") and r.system != "kt-peer" and r.losses]
    if len(kt) < 2:
        return None
    ref, worst, steps = kt[0], 0.0, 0
    for r in kt[1:]:
        n = min(len(r.losses), len(ref.losses))
        steps = max(steps, n)
        for a, b in zip(r.losses[:n], ref.losses[:n]):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return ref.system, worst, steps


def print_table(records: list[E2ERecord], cutoff_len: int, grad_accum: int) -> None:
    if not records:
        return
    r0 = records[0]
    rounds = max(r.round for r in records)

    def base_of(rec: E2ERecord) -> E2ERecord | None:  # the peft run of its round, else the first one
        peft = [r for r in records if r.system == "peft" and r.tok_s]
        return next((r for r in peft if r.round == rec.round), peft[0] if peft else None)

    print(
        f"\nllamafactory-cli train, {r0.preset} x{r0.layers} layers, cutoff_len {cutoff_len}, batch 1 x "
        f"{grad_accum} accumulation; tokens/s between the first and last logged steps (LF's trainer_log.jsonl)"
    )
    head = f"{'system':<20}" + (f"{'round':>6}" if rounds > 1 else "")
    head += f"{'tok/s':>9}{'x peft':>8}{'last half':>10}{'GPU peak':>10}{'x peft':>8}"
    head += f"{'host peak':>11}{'host rise':>11}"
    head += f"{'ms/micro':>10}{'predicted':>11}{'host main':>10}{'GPU busy':>9}{'loss 1':>9}"
    print(head)
    for r in records:
        base = base_of(r)
        tok = f"{r.tok_s:,.0f}" if r.tok_s else "-"
        half = f"{r.tok_s_last_half:,.0f}" if r.tok_s_last_half else "-"
        xs = f"{r.tok_s / base.tok_s:.2f}" if base and r.tok_s else "-"
        gpu = f"{r.gpu_peak_bytes / GIB:.2f}G" if r.gpu_peak_bytes else "-"
        xg = (
            f"{r.gpu_peak_bytes / base.gpu_peak_bytes:.2f}"
            if base and base.gpu_peak_bytes and r.gpu_peak_bytes
            else "-"
        )
        meas = f"{r.measured_micro_s * 1e3:.0f}" if r.measured_micro_s else "-"
        pred = f"{r.predicted_micro_s * 1e3:.0f}" if r.predicted_micro_s else "-"
        loss = f"{r.first_loss:.4f}" if r.first_loss is not None else "-"
        # the main thread's CPU ms a step over the step's wall ms (``host_time.py``)
        hm = f"{r.host_main_ms / r.host_step_ms:.0%}" if r.host_main_ms and r.host_step_ms else "-"
        busy = f"{r.gpu_util:.0f}%" if r.gpu_util is not None else "-"
        rnd = f"{r.round:>6}" if rounds > 1 else ""
        print(
            f"{r.system:<20}{rnd}{tok:>9}{xs:>8}{half:>10}{gpu:>10}{xg:>8}{r.host_peak_bytes / GIB:>10.1f}G"
            f"{r.host_rise_bytes / GIB:>10.1f}G{meas:>10}{pred:>11}{hm:>10}{busy:>9}{loss:>9}"
            + (f"  {r.note}" if r.note else "")
        )
    bound = [r for r in records if r.link_bound_tok_s]
    if bound:
        print("link bounds (a run's bytes streamed a step at its planned host -> GPU rate):")
        for r in bound:
            reached = f", {r.tok_s / r.link_bound_tok_s:.0%} reached" if r.tok_s else ""
            print(f"  {r.system:<30} {r.link_bound_tok_s:,.0f} tok/s{reached}")
    if rounds > 1:
        print(median_summary(records))
    agree = loss_agreement(records)
    if agree is not None:
        ref, worst, steps = agree
        print(
            f"kt-ft systems' losses over {steps} logged steps: at most {worst:.2e} relative from {ref}'s "
            "(the same adapter from the same start: placement arithmetic only)"
        )


def median_summary(records: list[E2ERecord]) -> str:
    """Each system's median tokens/s over its rounds (its range), and the ratio of that median to
    peft's; the GPU peak as its largest."""
    import statistics

    names = list(dict.fromkeys(r.system for r in records))
    rates = {n: [r.tok_s for r in records if r.system == n and r.tok_s] for n in names}
    peft = statistics.median(rates["peft"]) if rates.get("peft") else None
    lines = ["medians over the rounds:"]
    for n in names:
        if not rates[n]:
            lines.append(f"  {n:<30} no rate")
            continue
        med = statistics.median(rates[n])
        ratio = f", {med / peft:.2f}x peft's median" if peft else ""
        peaks = [r.gpu_peak_bytes for r in records if r.system == n and r.gpu_peak_bytes]
        gpu = f", GPU peak up to {max(peaks) / GIB:.2f}G" if peaks else ""
        lines.append(
            f"  {n:<30} {med:,.0f} tok/s ({min(rates[n]):,.0f}-{max(rates[n]):,.0f}, {len(rates[n])} runs){ratio}{gpu}"
        )
    return "\n".join(lines)
