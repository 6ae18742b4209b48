"""Tiny random models of the real families, built from configs (no download)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kt_ft.models import FAMILIES


def tiny_model(family: str = "qwen3_moe", seed: int = 0, vocab: int = 97, **overrides):
    cfg = {**FAMILIES[family].demo_config, **overrides}
    config = AutoConfig.for_model(family, vocab_size=vocab, pad_token_id=0, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF inits the router with zeros in some versions: give it real routing so experts differ.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return model
