"""`kt-ft bench --parts e2e`: a run's memory and GPU use, watched from outside its process.

``Monitor`` polls the driver (``nvidia-smi``) and the host's used memory while one
`llamafactory-cli train` runs, and keeps their peaks, the host peak before training started, a
timeline of host memory and the GPU's utilization while training.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

GIB = 2**30


def host_used_bytes() -> int:
    """MemTotal - MemAvailable from /proc/meminfo (what ``free`` calls used; page cache excluded)."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


# the line LLaMA-Factory's trainer logs when training starts (the model is loaded by then)
TRAIN_START = "***** Running training *****"


class Monitor:
    """Polls the device memory the driver reports (``nvidia-smi``, GPU ``gpu_index``) and host used
    memory while a run lasts; keeps the peaks (bytes), and the GPU's mean utilization (the driver's
    share of time a kernel ran) once training started (``gpu_util``: near 100 a run waits on the
    GPU, well under it on the host). With ``log_path``, the host peak is also
    kept for the time before ``TRAIN_START`` appears in that log (``host_peak_load``: loading and
    preparing the model, where a second copy of weights would show) and a timeline of host used
    memory, one sample a second, goes to ``timeline_path`` (CSV: seconds, GiB, phase)."""

    def __init__(
        self,
        gpu_index: str | None,
        interval_s: float = 0.2,
        log_path: Path | None = None,
        timeline_path: Path | None = None,
    ) -> None:
        self.gpu_index, self.interval_s = gpu_index, interval_s
        self.log_path, self.timeline_path = log_path, timeline_path
        self.gpu_peak: int | None = None
        self.host_peak = 0
        self.host_peak_load = 0
        self.training = False
        self._util: list[int] = []  # utilization.gpu samples (percent) while training
        self._log_offset = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._smi: subprocess.Popen | None = None

    def __enter__(self) -> Monitor:
        self._threads.append(threading.Thread(target=self._poll_host, daemon=True))
        if self.gpu_index is not None and shutil.which("nvidia-smi"):
            ms = str(max(50, int(self.interval_s * 1000)))
            self._smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits",
                 "-i", self.gpu_index, "-lms", ms],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            self._threads.append(threading.Thread(target=self._read_smi, daemon=True))
        for t in self._threads:
            t.start()
        return self

    def _training_started(self) -> bool:
        """Whether TRAIN_START is in the log yet (read on from where the last look stopped)."""
        if self.training or self.log_path is None:
            return self.training
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(max(0, self._log_offset - len(TRAIN_START)))
                text = f.read()
                self._log_offset = f.tell()
        except OSError:
            return False
        self.training = TRAIN_START in text
        return self.training

    def _poll_host(self) -> None:
        t0, last = time.perf_counter(), -1.0
        out = open(self.timeline_path, "w") if self.timeline_path is not None else None
        try:
            if out is not None:
                out.write("seconds,host_used_gib,phase\n")
            while not self._stop.is_set():
                used = host_used_bytes()
                self.host_peak = max(self.host_peak, used)
                training = self._training_started()
                if not training:
                    self.host_peak_load = max(self.host_peak_load, used)
                now = time.perf_counter() - t0
                if out is not None and now - last >= 1.0:
                    out.write(f"{now:.1f},{used / GIB:.2f},{'train' if training else 'load'}\n")
                    out.flush()
                    last = now
                self._stop.wait(self.interval_s)
        finally:
            if out is not None:
                out.close()

    def _read_smi(self) -> None:
        assert self._smi is not None and self._smi.stdout is not None
        for line in self._smi.stdout:
            try:
                mib, util = (int(v) for v in line.strip().split(","))
            except ValueError:
                continue
            used = mib * 2**20
            self.gpu_peak = used if self.gpu_peak is None else max(self.gpu_peak, used)
            if self.training:
                self._util.append(util)

    @property
    def gpu_util(self) -> float | None:
        """Mean GPU utilization (percent) over the samples taken while training, or None."""
        return sum(self._util) / len(self._util) if self._util else None

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait()
        for t in self._threads:
            t.join(timeout=5)
