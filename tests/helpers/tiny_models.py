"""Tiny random models of the real families, built from configs (no download)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kt_ft.plan.families import FAMILIES


def tiny_model(family: str = "qwen3_moe", seed: int = 0, vocab: int = 97, **overrides):
    """A random fp32 model of ``family`` (``FAMILIES[family].demo_config`` + ``overrides``)."""
    fam = FAMILIES[family]
    cfg = {**fam.demo_config, **overrides}
    config = AutoConfig.for_model(fam.demo_type, vocab_size=vocab, pad_token_id=0, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF inits the router with zeros in some versions: give it real routing so experts differ.
    # DeepSeek-V3 / GLM-4.5 select experts with a bias added to the scores: make it non-zero too.
    # gpt_oss: HF inits the expert biases to zero; gate/up biases N(0, 5^2) put about a sixth of
    # the gate/up pre-activations past the clamp limit (7), so both sides of its clamps train.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("gate.weight", "mlp.router.weight")):
                p.normal_(0, 0.5)
            elif n.endswith("experts.gate_up_proj_bias"):
                p.normal_(0, 5.0)
            elif n.endswith("experts.down_proj_bias"):
                p.normal_(0, 0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model
