"""One optimizer step of a real `llamafactory-cli train` run under ``torch.profiler``.

``KT_FT_PROFILE=DIR`` (read once, when LLaMA-Factory's tuner is imported): optimizer step 3 (1-based,
so start-up and the first step stay out; ``DIR,step=N``: the N-th) of this run -- every
micro-batch's forward and backward, gradient clipping and the optimizer -- is recorded with CPU and
CUDA activities, and ``DIR/step<N>.txt`` gets the operator tables (by self CUDA time and by self CPU
time) with the step's wall time; ``DIR,trace`` adds a gzipped Chrome trace (``settings.parse_profile``).
Works for ``use_kt`` true and false alike (the HF+PEFT baseline is profiled the same way).

Why in the product and not in a bench: the in-process bench's step did not predict the
`llamafactory-cli train` step (its own loop, fused AdamW, no gradient clipping, no
LLaMA-Factory data path); only the real run says where its time goes.
"""

from __future__ import annotations

import gzip
import shutil
import time
from pathlib import Path

from transformers import TrainerCallback

from kt_ft.base import settings
from kt_ft.base.log import get_logger

logger = get_logger(__name__)


class StepProfiler(TrainerCallback):
    """Profiles optimizer step ``step`` (1-based) into ``directory`` (module doc)."""

    def __init__(self, directory: str | Path, step: int = 3, trace: bool = False) -> None:
        self.directory, self.step, self.trace = Path(directory), step, trace
        self._prof = None
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 != self.step or self._prof is not None:
            return
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._prof is None or state.global_step != self.step:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        if not state.is_world_process_zero:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        avg = prof.key_averages()
        text = [f"optimizer step {self.step}: {wall * 1e3:.1f} ms wall (under the profiler)\n"]
        if torch.cuda.is_available():
            text += ["## by self CUDA time\n", avg.table(sort_by="self_cuda_time_total", row_limit=60), "\n"]
        text += ["## by self CPU time\n", avg.table(sort_by="self_cpu_time_total", row_limit=60), "\n"]
        text += ["## by total CPU time\n", avg.table(sort_by="cpu_time_total", row_limit=60), "\n"]
        out = self.directory / f"step{self.step}.txt"
        out.write_text("".join(text))
        logger.info(f"profiled optimizer step {self.step} ({wall * 1e3:.0f} ms): {out}")
        if self.trace:
            raw = self.directory / f"step{self.step}.trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()


def profiler_from_env() -> StepProfiler | None:
    """The profiler ``KT_FT_PROFILE`` asks for (logged), or None."""
    request = settings.profile()
    if request is None:
        return None
    logger.info(
        f"KT_FT_PROFILE={request.value()}: optimizer step {request.step} profiled into {request.directory}"
        f" (trace: {request.trace})"
    )
    return StepProfiler(request.directory, request.step, request.trace)
