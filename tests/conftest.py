import os

import pytest
import torch

# Tests are small: two intra-op threads match CI's two cores and keep timings stable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _whole_gpu_allocator():
    """A test that plans under ``kt_gpu_memory`` holds the CUDA allocator to a fraction of the GPU
    (``placement/runtime.limit_allocator``); the tests after it get the whole GPU back."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.fixture(autouse=True)
def _family_rotary_restored():
    """A kt-ft run in this process replaces transformers' ``apply_rotary_pos_emb`` (models/rotary.py);
    the tests after it get the families' own function back."""
    yield
    from kt_ft.backends.rotary import uninstall_fused_rotary

    uninstall_fused_rotary()


@pytest.fixture
def rng():
    """A fresh, seeded generator per test: inputs are random but the run is reproducible."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """`kt-ft make-demo-model` output (tiny qwen3_moe, tokenizer, dataset), built once per run."""
    from kt_ft.integrations.demo.text import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def saved_adapter(demo_assets, tmp_path_factory):
    """(model, adapter dir, reference logits, trainable-param copies) of a random-LoRA kt model
    of the demo, saved through LLaMA-Factory's model (see tests/helpers/kt_adapters.py)."""
    pytest.importorskip("llamafactory")
    from helpers.kt_adapters import random_lora_adapter

    out = tmp_path_factory.mktemp("adapter") / "out"
    model, ref, state = random_lora_adapter(demo_assets, out)
    return model, out, ref, state


@pytest.fixture(scope="session")
def one_process_run(demo_assets, tmp_path_factory):
    """The one-process run the DDP and FSDP2 tests both compare against (micro-batch 4, 4 steps,
    a checkpoint at step 2, gradients clipped at 0.5): trained once a session, not once a module."""
    pytest.importorskip("llamafactory")
    from helpers.lf_runs import SharedRun

    out = tmp_path_factory.mktemp("one_process") / "one"
    return SharedRun(
        demo_assets, out, max_steps=4, save_steps=2, max_grad_norm=0.5, per_device_train_batch_size=4
    )
