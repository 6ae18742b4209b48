"""`kt-ft bench --parts e2e`: one system's run, `llamafactory-cli train` in its own process,
measured from outside (``Monitor``) and read from its logs (``e2e_logs.py``) into an ``E2ERecord``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kt_ft.base import settings
from kt_ft.integrations.bench.e2e_logs import (
    _CPU_OP,
    _HOST,
    _PREDICTED,
    failure_note,
    last_half_rate,
    link_bound,
    rate_from_log,
    read_trainer_log,
)
from kt_ft.integrations.bench.e2e_monitor import Monitor, host_used_bytes
from kt_ft.integrations.bench.e2e_systems import System


@dataclass
class E2ERecord:
    system: str
    preset: str
    layers: int
    rc: int
    seconds: float  # wall time of the whole process (load, train, save)
    steps_logged: int = 0
    tokens_per_step: float | None = None
    tok_s: float | None = None  # between the first and the last logged step
    # over the last half of the steps: a placement: auto run settles its split in its first steps
    # (calibration, trial: placement/runtime.py), a long run runs at this rate
    tok_s_last_half: float | None = None
    step_s: list[float] = field(default_factory=list)  # per optimizer step after the first
    first_loss: float | None = None
    losses: list[float] = field(default_factory=list)  # each logged step's (LF's trainer_log.jsonl)
    gpu_peak_bytes: int | None = None
    host_peak_bytes: int = 0
    host_rise_bytes: int = 0
    # host peak before LF's trainer started (load and preparation); 0 where it never started
    host_peak_load_bytes: int = 0
    predicted_micro_s: float | None = None  # cost model: one micro-batch (placement: auto)
    # the CPU expert op's wall time a micro-batch, all layers, as the run's summary line states it
    # (over every micro-batch of the run; ``--parts op`` times one layer's op at the same shape)
    cpu_op_micro_s: float | None = None
    cap_gib: float | None = None
    grad_accum: int = 1  # micro-batches an optimizer step
    note: str = ""
    round: int = 1  # ``--e2e-rounds``: which pass over the systems (1-based)
    # ``KT_FT_RUN_REPORT``'s host-time line (``trainer/host_time.py``): median wall ms a step and the main
    # thread's CPU ms in it, unprofiled
    host_step_ms: float | None = None
    host_main_ms: float | None = None
    host_line: str = ""
    gpu_util: float | None = None  # mean GPU utilization while training, percent (``Monitor``)
    # a run that streamed experts: the tokens/s its link allows at most (``link_bound``)
    link_bound_tok_s: float | None = None

    @property
    def measured_micro_s(self) -> float | None:
        """Measured seconds a micro-batch: the optimizer step over its micro-batches."""
        if not self.step_s or self.tok_s is None or not self.tokens_per_step:
            return None
        return self.tokens_per_step / self.tok_s / self.grad_accum


def llamafactory_cli() -> str:
    """The ``llamafactory-cli`` on PATH, else the one beside this Python."""
    return shutil.which("llamafactory-cli") or str(Path(sys.executable).with_name("llamafactory-cli"))


def lf_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, offline (no hub), plus ``extra``: what each LF run gets."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(extra or {})}


def run_system(
    system: System,
    recipe: Path,
    run_dir: Path,
    *,
    preset: str,
    layers: int,
    grad_accum: int,
    gpu_index: str | None,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> E2ERecord:
    """One `llamafactory-cli train recipe` in its own process, measured from outside."""
    cli = llamafactory_cli()
    log_path = run_dir / "train.log"
    idle = host_used_bytes()
    t0 = time.perf_counter()
    with (
        open(log_path, "w") as log,
        Monitor(gpu_index, log_path=log_path, timeline_path=run_dir / "host_memory.csv") as mon,
    ):
        proc = subprocess.Popen(
            [cli, "train", str(recipe)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=lf_env(env),
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            rc = rc if rc else -9
    seconds = time.perf_counter() - t0
    rows = read_trainer_log(run_dir / "output" / "trainer_log.jsonl")
    profiled = settings.parse_profile((env or {}).get("KT_FT_PROFILE"))
    skip = profiled.step if profiled is not None else None  # that step is left out of the rate
    rate, steps, per_step = rate_from_log(rows, skip_step=skip)
    text = log_path.read_text(errors="replace")
    pred = _PREDICTED.findall(text)
    op = _CPU_OP.findall(text)
    host = _HOST.findall(text)
    rec = E2ERecord(
        system=system.name,
        preset=preset,
        layers=layers,
        rc=rc,
        seconds=seconds,
        steps_logged=len(rows),
        tokens_per_step=per_step,
        tok_s=rate,
        tok_s_last_half=last_half_rate(rows, skip),
        step_s=steps,
        first_loss=rows[0].get("loss") if rows else None,
        losses=[r["loss"] for r in rows],
        gpu_peak_bytes=mon.gpu_peak,
        gpu_util=mon.gpu_util,
        host_peak_bytes=mon.host_peak,
        host_rise_bytes=max(0, mon.host_peak - idle),
        host_peak_load_bytes=mon.host_peak_load if mon.training else 0,
        predicted_micro_s=float(pred[-1]) / 1e3 if pred else None,
        cpu_op_micro_s=float(op[-1]) / (len(rows) * grad_accum) if op and rows else None,
        cap_gib=system.cap_gib,
        grad_accum=grad_accum,
    )
    rec.link_bound_tok_s = link_bound(text, len(rows), per_step)
    if host:
        rec.host_line, wall, main = host[-1]
        rec.host_step_ms, rec.host_main_ms = float(wall), float(main)
    if rc != 0:
        rec.note = f"exit {rc}: " + failure_note(text)
    elif rate is None:
        rec.note = "fewer than two logged steps: no rate"
    return rec
