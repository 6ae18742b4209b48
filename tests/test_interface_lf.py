"""`kt-ft models --lf` (kt_ft/integrations/cli/lf_check.py): derived model types train through
`llamafactory-cli train` with the same lr-0 losses with kt-ft as without, and the check can fail."""

import math

import pytest
import torch

from kt_ft.integrations.cli.lf_check import (
    LOSS_RTOL,
    LfCheck,
    _verdict,
    compare_losses,
    lf_parity,
    sharpen_demo,
)

REF = [10.729056358337402, 10.176989555358887, 10.680719375610352]


def test_compare_losses_accepts_equal_and_rounding():
    assert compare_losses(REF, REF) is None
    assert compare_losses([x * (1 + 0.5 * LOSS_RTOL) for x in REF], REF) is None


@pytest.mark.parametrize(
    "kt, why",
    [
        ([REF[0], REF[1] * (1 + 3 * LOSS_RTOL), REF[2]], "step 2: loss"),
        (REF[:2], "2 kt-ft losses vs 3"),
        ([REF[0], math.nan, REF[2]], "step 2: loss nan"),
    ],
)
def test_compare_losses_rejects_perturbed(kt, why):
    assert why in compare_losses(kt, REF)


def test_verdict_blames_llamafactory_when_the_reference_fails():
    """A run without kt-ft failing is LLaMA-Factory's limit (the table says so), not a kt-ft failure."""
    log = "Traceback ...\nImportError: cannot import name 'x'\n"
    status, detail = _verdict({False: (1, log), True: (0, "")}, {False: [], True: REF}, 3)
    assert status == "LF cannot train" and "ImportError: cannot import name 'x'" in detail
    assert "use_kt=true run trained" in detail
    status, detail = _verdict({False: (0, ""), True: (1, "RuntimeError: boom")}, {False: REF, True: []}, 3)
    assert (status, detail) == ("fail", "use_kt=true run failed: RuntimeError: boom")
    assert LfCheck("pass", "3 lr-0 losses", "qwen", "no template").cell() == (
        "pass; template `qwen` (no template); 3 lr-0 losses"
    )


def test_sharpened_demo_loss_sees_a_one_percent_expert_error(tmp_path):
    """What makes the LF parity able to fail: on the sharpened demo, scaling every expert's output
    by 1.01 moves the loss by more than LOSS_RTOL (a random demo's loss is ~ln(vocab) whatever
    the experts compute)."""
    from transformers import AutoModelForCausalLM

    from kt_ft.integrations.demo.text import make_demo_model
    from kt_ft.plan.interface import interface_experts

    demo = make_demo_model(tmp_path / "demo", family="dots1")
    sharpen_demo(demo / "model")
    model = AutoModelForCausalLM.from_pretrained(demo / "model", dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids, labels=ids).loss.item()
        for _, experts in interface_experts(model):
            experts.down_proj.mul_(1.01)
        after = model(input_ids=ids, labels=ids).loss.item()
    assert abs(after - before) > 3 * LOSS_RTOL * before, (before, after)


# dots1: grouped sigmoid router with a score-correction bias and a shared expert, template qwen
# (none known). One type keeps `make test` within its time; every other type is checked the same
# way by `kt-ft models --lf` (docs/models.md), and the hand families train through
# llamafactory-cli in test_cli_train.py.
@pytest.mark.lf_subprocess
@pytest.mark.parametrize("model_type", ["dots1"])
def test_lf_lr0_loss_parity(model_type, tmp_path):
    pytest.importorskip("llamafactory")
    check = lf_parity(model_type, tmp_path)
    assert check.status == "pass", check.cell() + f"\nlogs: {tmp_path}/use_kt_*.log"
