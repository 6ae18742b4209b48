"""Helpers to run `llamafactory-cli train` on the demo recipe as a subprocess (tests only)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "demo_tiny_qwen3moe.yaml"
CLI = Path(sys.executable).with_name("llamafactory-cli")
MANIFEST = "kt_adapter_manifest.json"

# Data-parallel runs against one process with the same global batch (tests/test_distributed.py
# says why these hold and what was seen): losses relative; tensors max |a-b| <= rtol x max |b|.
LOSS_RTOL = 1e-5
TENSOR_RTOL = {"kt_expert_lora_master": 1e-4, "adapter_model": 1e-4, "fused_expert_lora": 1e-2}


def start_train(
    demo_assets: Path,
    out: Path,
    *,
    env: dict | None = None,
    recipe: Path = RECIPE,
    accelerate: list[str] | None = None,
    **overrides,
) -> subprocess.Popen:
    """Start ``llamafactory-cli train`` on the demo recipe (fp32, dataloader_num_workers 0, seed 42),
    or ``recipe``, with ``key=value`` overrides (and extra environment variables ``env``); with
    ``accelerate`` (its ``launch`` options), ``accelerate launch`` on LLaMA-Factory's launcher."""
    args = {
        "model_name_or_path": demo_assets / "model",
        "dataset_dir": demo_assets / "data",
        "output_dir": out,
        "logging_steps": 1,
        "save_steps": 3,
        **overrides,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 (closed by finish())
    if accelerate is None:
        command = [str(CLI), "train"]
    else:
        launcher = importlib.util.find_spec("llamafactory.launcher").origin
        command = [str(CLI.with_name("accelerate")), "launch", *accelerate, launcher]
    proc = subprocess.Popen(
        [*command, str(recipe), *(f"{k}={v}" for k, v in args.items())],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})},
    )
    proc.log_path = log.name
    proc.log_file = log
    return proc


def torchrun_env(procs: int) -> dict[str, str]:
    """Environment for ``llamafactory-cli train`` to launch ``procs`` processes through torchrun
    (LLaMA-Factory calls ``torchrun`` by name: the venv's bin goes first on PATH)."""
    return {
        "FORCE_TORCHRUN": "1",
        "NNODES": "1",
        "NPROC_PER_NODE": str(procs),
        "PATH": f"{CLI.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def failure_text(log: str, tail: int = 3000) -> str:
    """What a failed run said: lines that name a crash (a C++ abort names itself before torchrun's
    summary, which the tail alone would cut off), then the log's tail."""
    marks = ("terminate called", "what():", "Fatal Python error", "Aborted", "Segmentation fault", "Error")
    crash = [line for line in log.splitlines() if any(m in line for m in marks)]
    return "\n".join(crash[-20:]) + "\n...\n" + log[-tail:]


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    """Wait for a ``start_train`` run (at most ``timeout`` s); returns (its exit status, its log text)."""
    rc = proc.wait(timeout=timeout)
    proc.log_file.close()
    return rc, Path(proc.log_path).read_text()


def kill_when_complete(proc: subprocess.Popen, checkpoint: Path, timeout: float = 300) -> None:
    """SIGKILL ``proc`` as soon as ``checkpoint``'s manifest exists (the save is complete)."""
    deadline = time.monotonic() + timeout
    while not (checkpoint / MANIFEST).is_file():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before {checkpoint} was complete")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{checkpoint} not complete after {timeout} s")
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.log_file.close()


def step_losses(out: Path) -> dict[int, float]:
    """step -> training loss from trainer_state.json's log_history (logging_steps=1)."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """PEFT adapter + expert LoRA (bf16 fused file and fp32 master) tensors of an adapter dir,
    keys prefixed by file."""
    out = {}
    for name in (
        "adapter_model.safetensors",
        "fused_expert_lora.safetensors",
        "kt_expert_lora_master.safetensors",
    ):
        out.update({f"{name}:{k}": v for k, v in load_file(str(directory / name)).items()})
    return out


def assert_close_runs(got_dir, want_dir, steps, loss_rtol=LOSS_RTOL) -> None:
    """Two runs' output dirs logged losses at exactly ``steps`` (``got_dir``), each within ``loss_rtol``
    of ``want_dir``'s, and hold the same adapter tensors, each within ``TENSOR_RTOL`` of its file
    (max |a-b| <= rtol x max |b|), with some non-zero fused expert-LoRA B. Returns nothing."""
    want, got = step_losses(want_dir), step_losses(got_dir)
    assert sorted(got) == steps, got
    for s in steps:
        assert abs(got[s] - want[s]) <= loss_rtol * abs(want[s]), f"step {s}: loss {got[s]} vs {want[s]}"
    a, b = adapter_tensors(got_dir), adapter_tensors(want_dir)
    assert a.keys() == b.keys()
    for k in a:
        rtol = TENSOR_RTOL[k.split(".safetensors")[0]]
        err = (a[k].double() - b[k].double()).abs().max().item()
        scale = b[k].double().abs().max().item()
        assert err <= rtol * scale, f"{k}: max |diff| {err:.3g} > {rtol} x max |ref| {scale:.3g}"
    assert any("fused_expert_lora" in k and k.endswith("_b") and b[k].abs().max() > 0 for k in b)


class SharedRun:
    """One ``start_train`` run that several test modules compare against: started by the first
    that asks (beside its own runs, so the two overlap), trained once a session."""

    def __init__(self, demo_assets: Path, out: Path, **overrides) -> None:
        self.demo_assets, self.out, self.overrides = demo_assets, out, overrides
        self._proc: subprocess.Popen | None = None
        self._log: str | None = None

    def start(self) -> None:
        if self._proc is None:
            self._proc = start_train(self.demo_assets, self.out, **self.overrides)

    def wait(self) -> tuple[Path, str]:
        """(output dir, log) once the run has finished; fails the caller if it did not train."""
        self.start()
        if self._log is None:
            rc, log = finish(self._proc)
            assert rc == 0, failure_text(log)
            self._log = log
        return self.out, self._log
