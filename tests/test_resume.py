"""Exact resume through real `llamafactory-cli train` subprocesses, and fail-closed resume.

Per gradient_accumulation_steps (1 and 2): 6 uninterrupted steps vs resuming, in a new
process, from checkpoint-3 of a run that was SIGKILLed (see ``runs``), to step 6. The demo recipe is fp32 on the CPU with
dataloader_num_workers 0, so the resumed run must match BITWISE (tolerance 0): every step's
loss in trainer_state.json's log_history, the final adapter_model.safetensors and the final
fused_expert_lora.safetensors. That needs the non-expert and expert LoRA, the optimizer state
of both, the scheduler, the RNG and the data position to come back exactly.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers.lf_runs import MANIFEST, adapter_tensors, finish, kill_when_complete, start_train, step_losses

pytest.importorskip("llamafactory")
pytestmark = pytest.mark.lf_subprocess

GA = (1, 2)


@pytest.fixture(scope="module")
def runs(demo_assets, tmp_path_factory):
    """Five subprocesses in two waves (the 2-core machine runs two or three at once).

    Wave 1, per GA: a run set to go on for 1000 steps (constant LR: the step count changes
    nothing before it is reached) is SIGKILLed as soon as checkpoint-6 is complete; that
    checkpoint, an uninterrupted 6 steps, is the reference. Wave 2 resumes each from the
    killed run's checkpoint-3 to max_steps 6: GA 1 automatically (overwrite_output_dir false,
    later checkpoints moved away first), GA 2 with resume_from_checkpoint. And a copy of
    checkpoint-3 next to a checkpoint-6 whose save "was killed" (no manifest) must be refused.
    """
    root = tmp_path_factory.mktemp("resume")
    batch = {1: 8, 2: 4}  # same examples per optimizer step for both GA values
    common = {ga: {"gradient_accumulation_steps": ga, "per_device_train_batch_size": batch[ga]} for ga in GA}
    killed = {ga: start_train(demo_assets, root / f"run{ga}", max_steps=1000, **common[ga]) for ga in GA}
    for ga in GA:
        kill_when_complete(killed[ga], root / f"run{ga}" / "checkpoint-6")
        assert "train_runtime" not in (root / f"run{ga}.log").read_text(), "the run ended before the kill"
        shutil.move(root / f"run{ga}" / "checkpoint-6", root / f"straight{ga}")
        for d in (root / f"run{ga}").glob("checkpoint-*"):
            if d.name != "checkpoint-3":  # whatever the kill left after step 6
                shutil.rmtree(d)
    half = root / "incomplete" / "out"
    shutil.copytree(root / "run1" / "checkpoint-3", half / "checkpoint-3")
    shutil.copytree(root / "run1" / "checkpoint-3", half / "checkpoint-6")
    (half / "checkpoint-6" / MANIFEST).unlink()  # as if killed while checkpoint-6 was being written

    resumed = {
        1: start_train(demo_assets, root / "run1", max_steps=6, overwrite_output_dir="false", **common[1]),
        2: start_train(
            demo_assets,
            root / "run2",
            max_steps=6,
            resume_from_checkpoint=root / "run2" / "checkpoint-3",
            **common[2],
        ),
    }
    refused = start_train(demo_assets, half, max_steps=6, overwrite_output_dir="false")
    for ga in GA:
        rc, log = finish(resumed[ga])
        assert rc == 0, log[-3000:]
        assert "resumed expert LoRA from" in log and "checkpoint-3" in log
    return root, finish(refused)


@pytest.mark.parametrize("ga", GA)
def test_kill_and_resume_matches_straight_run_bitwise(runs, ga):
    """Tolerance 0: fp32 CPU, same thread counts, same data order -> identical floats."""
    root, _ = runs
    straight, resumed = root / f"straight{ga}", root / f"run{ga}"
    want, got = step_losses(straight), step_losses(resumed)
    assert sorted(want) == [1, 2, 3, 4, 5, 6], want
    assert got == want, f"losses differ after resume:\n straight {want}\n resumed  {got}"
    a, b = adapter_tensors(straight), adapter_tensors(resumed)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"final tensors differ: {different[:4]}"
    assert any("fused_expert_lora" in k and k.endswith("_b") and a[k].abs().max() > 0 for k in a)


def test_resume_refuses_incomplete_latest_checkpoint(runs):
    """Auto-resume picks the latest checkpoint-N; one without a manifest stops the run."""
    _, (rc, log) = runs
    assert rc != 0
    assert "checkpoint-6/kt_adapter_manifest.json: missing" in log, log[-3000:]
    assert "complete checkpoints here:" in log and "checkpoint-3" in log
    assert "'loss'" not in log and "train_runtime" not in log  # never a fresh start
