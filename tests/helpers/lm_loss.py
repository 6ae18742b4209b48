"""The chunked causal-LM loss's twins (tests/test_lm_loss.py, tests/test_multimodal.py): one model with
kt-ft's chunked loss and its copy with the model's own loss."""

from __future__ import annotations

import os

import kt_ft
from kt_ft.backends import lm_loss


def apply_both(base, twin, config) -> None:
    """``kt_ft.apply`` on ``base`` (the chunked loss) and on its copy ``twin`` with
    KT_FT_FUSIONS=lora,norm,rope (the model's own loss); checks which got which. Returns nothing: both
    models are changed in place."""
    kt_ft.apply(base, config)
    before = os.environ.get("KT_FT_FUSIONS")
    os.environ["KT_FT_FUSIONS"] = "lora,norm,rope"
    try:
        kt_ft.apply(twin, config)
    finally:
        if before is None:
            del os.environ["KT_FT_FUSIONS"]
        else:
            os.environ["KT_FT_FUSIONS"] = before
    assert getattr(lm_loss.causal_lm_module(base), "_kt_ft_chunked_loss", False)
    assert not getattr(lm_loss.causal_lm_module(twin), "_kt_ft_chunked_loss", False)
