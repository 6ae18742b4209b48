"""Exact resume through real `llamafactory-cli train` subprocesses, and fail-closed resume.

Per gradient_accumulation_steps (1 and 2): a straight 6-step run vs a run SIGKILLed as soon as
checkpoint-3 is complete, then resumed to step 6. The demo recipe is fp32 on the CPU with
dataloader_num_workers 0, so the resumed run must match BITWISE (tolerance 0): every step's
loss in trainer_state.json's log_history, the final adapter_model.safetensors and the final
fused_expert_lora.safetensors. That needs the non-expert and expert LoRA, the optimizer state
of both, the scheduler, the RNG and the data position to come back exactly.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from lf_runs import MANIFEST, adapter_tensors, finish, kill_when_complete, start_train, step_losses

pytest.importorskip("llamafactory")
pytestmark = pytest.mark.slow

GA = (1, 2)


@pytest.fixture(scope="module")
def runs(demo_assets, tmp_path_factory):
    """All subprocesses of this file, two at a time per wave so the 2-core machine stays busy."""
    root = tmp_path_factory.mktemp("resume")
    batch = {1: 8, 2: 4}  # same examples per optimizer step for both GA values
    common = {ga: {"gradient_accumulation_steps": ga, "per_device_train_batch_size": batch[ga]} for ga in GA}
    # wave 1: straight runs, and runs that would go on for 1000 steps but are killed after checkpoint-3
    straight = {ga: start_train(demo_assets, root / f"straight{ga}", max_steps=6, **common[ga]) for ga in GA}
    killed = {ga: start_train(demo_assets, root / f"killed{ga}", max_steps=1000, **common[ga]) for ga in GA}
    for ga in GA:
        kill_when_complete(killed[ga], root / f"killed{ga}" / "checkpoint-3")
        assert "train_runtime" not in (root / f"killed{ga}.log").read_text(), "the run ended before the kill"
    for ga in GA:
        rc, log = finish(straight[ga])
        assert rc == 0, log[-3000:]
    # A kill lands anywhere after checkpoint-3 completed: a later checkpoint may be complete or
    # half written. Compare from step 3: keep only checkpoint-3 (an incomplete later one is the
    # fail-closed test below).
    half = root / "incomplete" / "out"
    half.mkdir(parents=True)
    shutil.copytree(root / "killed1" / "checkpoint-3", half / "checkpoint-3")
    shutil.copytree(root / "killed1" / "checkpoint-3", half / "checkpoint-6")
    (half / "checkpoint-6" / MANIFEST).unlink()  # as if killed while checkpoint-6 was being written
    for ga in GA:
        for d in (root / f"killed{ga}").glob("checkpoint-*"):
            if d.name != "checkpoint-3":
                shutil.rmtree(d)
    bad = root / "truncated" / "out"
    shutil.copytree(root / "killed1" / "checkpoint-3", bad / "checkpoint-3")
    fused = bad / "checkpoint-3" / "fused_expert_lora.safetensors"
    fused.write_bytes(fused.read_bytes()[:-100])

    # wave 2: GA 1 resumes automatically (overwrite_output_dir false), GA 2 by resume_from_checkpoint
    resumed = {
        1: start_train(demo_assets, root / "killed1", max_steps=6, overwrite_output_dir="false", **common[1]),
        2: start_train(
            demo_assets,
            root / "killed2",
            max_steps=6,
            resume_from_checkpoint=root / "killed2" / "checkpoint-3",
            **common[2],
        ),
    }
    failing = {
        name: start_train(demo_assets, d, max_steps=6, overwrite_output_dir="false")
        for name, d in (("incomplete", half), ("truncated", bad))
    }
    results = {name: finish(p) for name, p in failing.items()}
    for ga in GA:
        rc, log = finish(resumed[ga])
        assert rc == 0, log[-3000:]
        assert "resumed expert LoRA from" in log and "checkpoint-3" in log
    return root, results


@pytest.mark.parametrize("ga", GA)
def test_kill_and_resume_matches_straight_run_bitwise(runs, ga):
    """Tolerance 0: fp32 CPU, same thread counts, same data order -> identical floats."""
    root, _ = runs
    straight, resumed = root / f"straight{ga}", root / f"killed{ga}"
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
    _, results = runs
    rc, log = results["incomplete"]
    assert rc != 0
    assert "checkpoint-6/kt_adapter_manifest.json: missing" in log, log[-3000:]
    assert "complete checkpoints here:" in log and "checkpoint-3" in log
    assert "'loss'" not in log and "train_runtime" not in log  # never a fresh start


def test_resume_refuses_truncated_fused_file(runs):
    _, results = runs
    rc, log = results["truncated"]
    assert rc != 0
    assert "checkpoint-3/fused_expert_lora.safetensors: size" in log and "(truncated?)" in log, log[-3000:]
    assert "train_runtime" not in log
