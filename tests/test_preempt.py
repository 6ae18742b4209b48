"""Preemption through real `llamafactory-cli train` subprocesses (kt_ft/integrations/trainer/preempt.py).

SIGTERM (and SIGINT) at a seeded random moment of training: the step under way finishes, a complete
checkpoint is written (manifest last), the process exits with 128 + the signal and a line naming the
checkpoint; resuming from it to step 6 gives every loss of an uninterrupted 6-step run and its final
adapters bitwise (the demo recipe: fp32 on the CPU, dataloader_num_workers 0). A second signal exits
at once, and the checkpoint complete before it stays complete. The seed is printed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers.lf_runs import MANIFEST, adapter_tensors, finish, start_train, step_losses

pytest.importorskip("llamafactory")
pytestmark = pytest.mark.lf_subprocess


def wait_for_step(proc, log: Path, step: int, timeout: float = 300) -> None:
    """Until the run's log shows training step ``step`` (LF logs every step: logging_steps 1)."""
    deadline = time.monotonic() + timeout
    while len(re.findall(r"'loss':", log.read_text())) < step:
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def straight(demo_assets, tmp_path_factory):
    """An uninterrupted 6-step run (save_steps 6): its losses and final checkpoint."""
    out = tmp_path_factory.mktemp("straight") / "out"
    rc, log = finish(start_train(demo_assets, out, max_steps=6, save_steps=6))
    assert rc == 0, log[-3000:]
    return out / "checkpoint-6"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_that_resumes_bitwise(demo_assets, straight, tmp_path, sig):
    seed = random.randrange(2**16)
    print(f"seed {seed}")
    rnd = random.Random(seed)
    out = tmp_path / "out"
    proc = start_train(demo_assets, out, max_steps=1000, save_steps=1000)
    wait_for_step(proc, Path(proc.log_path), rnd.randint(1, 3))
    time.sleep(rnd.uniform(0, 0.3))  # somewhere inside the next step
    os.kill(proc.pid, sig)
    rc, log = finish(proc)
    assert rc == 128 + sig, log[-3000:]
    done = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(done) == 1 and (done[0] / MANIFEST).is_file(), done
    step = int(done[0].name.split("-")[1])
    assert 1 <= step <= 5 and f"preempted: {done[0]} is complete" in log
    resumed = start_train(demo_assets, out, max_steps=6, save_steps=6, resume_from_checkpoint=done[0])
    rc, log = finish(resumed)
    assert rc == 0, log[-3000:]
    assert step_losses(out / "checkpoint-6") == step_losses(straight)
    want, got = adapter_tensors(straight), adapter_tensors(out / "checkpoint-6")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_second_signal_exits_at_once_and_keeps_the_last_checkpoint(demo_assets, tmp_path):
    out = tmp_path / "out"
    proc = start_train(demo_assets, out, max_steps=1000, save_steps=2)
    log_path = Path(proc.log_path)
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-2" / MANIFEST).is_file():
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.01)
    wait_for_step(proc, log_path, 3)
    before = {p.name: p.read_bytes() for p in (out / "checkpoint-2").iterdir() if p.is_file()}
    os.kill(proc.pid, signal.SIGTERM)
    # the second once the first one's handler has run (Python runs one handler for signals that
    # coincide), while the step finishes or the checkpoint is written
    while "received SIGTERM" not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGTERM)
    rc, log = finish(proc, timeout=60)
    assert rc == 128 + signal.SIGTERM, log[-3000:]
    assert "second signal (SIGTERM): exiting now" in log
    after = {p.name: p.read_bytes() for p in (out / "checkpoint-2").iterdir() if p.is_file()}
    assert after == before  # the complete checkpoint untouched
    for d in out.glob("checkpoint-*"):  # a later save, if one began, is complete or refused (no manifest)
        assert (
            d.name == "checkpoint-2" or not (d / MANIFEST).is_file() or (d / "trainer_state.json").is_file()
        )
