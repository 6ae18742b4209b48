import os

import pytest
import torch

# Tests are small: two intra-op threads match CI's two cores and keep timings stable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def rng():
    """A fresh, seeded generator per test: inputs are random but the run is reproducible."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """`kt-ft make-demo-model` output (tiny qwen3_moe, tokenizer, dataset), built once per run."""
    from kt_ft.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def saved_adapter(demo_assets, tmp_path_factory):
    """(model, adapter dir, reference logits, trainable-param copies) of a random-LoRA kt model
    of the demo, saved through LLaMA-Factory's model (see tests/kt_adapters.py)."""
    pytest.importorskip("llamafactory")
    from kt_adapters import random_lora_adapter

    out = tmp_path_factory.mktemp("adapter") / "out"
    model, ref, state = random_lora_adapter(demo_assets, out)
    return model, out, ref, state
