"""How busy the host is during a `llamafactory-cli train` step, without a profiler.

``KT_FT_RUN_REPORT=DIR``: at the end of every optimizer step the process's threads' CPU time is read
from ``/proc/self/task/*/stat`` (utime + stime, clock ticks), and at the end of training one line
gives, per step (the median over the steps after the first; the ``KT_FT_PROFILE`` step left out),
the wall time and the CPU time of the main thread (the forward and the optimizer), of each other
named thread (PyTorch's ``pt_autograd_<device>`` runs a GPU backward) and of the rest; it is
logged and written, with every step's figures, to ``DIR/host_time.json`` (by the first rank).

Why: a step whose main thread is busy most of its wall time is bound by the host's per-kernel
work (Python, dispatch, launches), not by the GPU; a profiler inflates exactly that work, so the
two systems of a benchmark are compared here on what their host did while not profiled. Linux
only (elsewhere the callback stays silent).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from transformers import TrainerCallback

from kt_ft.base import settings
from kt_ft.base.log import get_logger

logger = get_logger(__name__)
LINE_PREFIX = "host time a step"  # the e2e benchmark reads the line (``bench/e2e.py``)
_TASKS = Path("/proc/self/task")


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """{thread id: (its name, CPU seconds so far)} of this process's threads; {} off Linux."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, tuple[str, float]] = {}
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        # "tid (name) state ...": the name may hold spaces and parentheses, the fields follow the last ")"
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def busy_by_thread(before: dict, after: dict, main_tid: int) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu_seconds`` reads: "main" (``main_tid``), then by thread
    name for the others (threads of one name summed; a thread new since ``before`` counts from 0)."""
    out: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        d = cpu - before.get(tid, (name, 0.0))[1]
        key = "main" if tid == main_tid else name
        out[key] = out.get(key, 0.0) + d
    return out


def summary_line(steps: list[tuple[float, dict[str, float]]], top: int = 3) -> str | None:
    """One line from (wall seconds, busy_by_thread) per step: medians in ms, the main thread's share
    of the wall time, the ``top`` other names by CPU time, the rest summed."""
    if not steps:
        return None
    wall = statistics.median(w for w, _ in steps)
    names: dict[str, list[float]] = {}
    for _, busy in steps:
        for k, v in busy.items():
            names.setdefault(k, []).append(v)
    for v in names.values():  # a thread absent in some steps was idle there
        v.extend([0.0] * (len(steps) - len(v)))
    med = {k: statistics.median(v) for k, v in names.items()}
    main = med.pop("main", 0.0)
    others = sorted(med.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in others[:top])
    rest = sum(v for _, v in others[top:])
    return (
        f"{LINE_PREFIX} (median of {len(steps)} steps): wall {wall * 1e3:.0f} ms; CPU busy: main thread "
        f"{main * 1e3:.0f} ms ({main / wall:.0%} of the wall)"
        + (f", {shown}" if shown else "")
        + (f", other threads {rest * 1e3:.0f} ms" if len(others) > top else "")
    )


class HostTime(TrainerCallback):
    """Reads the threads' CPU time at each optimizer step's end; logs ``summary_line`` at the end."""

    def __init__(self, skip_step: int | None = None, directory: str | Path | None = None) -> None:
        self.skip_step = skip_step  # the profiled step (``KT_FT_PROFILE``): not a fair sample
        self.directory = Path(directory) if directory else None  # host_time.json goes there
        self.steps: list[tuple[float, dict[str, float]]] = []
        self._last: tuple[float, dict] | None = None
        self._main = os.getpid()

    def on_step_end(self, args, state, control, **kwargs):
        now = (time.perf_counter(), thread_cpu_seconds())
        if self._last is not None and state.global_step != self.skip_step:
            self.steps.append((now[0] - self._last[0], busy_by_thread(self._last[1], now[1], self._main)))
        self._last = now

    def on_train_end(self, args, state, control, **kwargs):
        line = summary_line(self.steps)
        if line is None or not state.is_world_process_zero:
            return
        logger.info(line)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            steps = [{"wall_s": w, "cpu_s": busy} for w, busy in self.steps]
            record = {"summary": line, "skipped_step": self.skip_step, "steps": steps}
            (self.directory / "host_time.json").write_text(json.dumps(record, indent=1) + "\n")


def host_time_from_env() -> HostTime | None:
    """The callback ``KT_FT_RUN_REPORT`` asks for, or None."""
    directory = settings.get("KT_FT_RUN_REPORT")
    if not directory:
        return None
    profiled = settings.profile()
    skip = profiled.step if profiled is not None else None
    return HostTime(skip_step=skip, directory=directory)
