"""The non-expert part of a training micro-batch, measured in the run that trains it.

The cost model's step is Σ (routed-expert layers) + the non-expert work (attention, dense and
shared MLPs, router, head and loss, their LoRA). Before a run starts the latter is its FLOPs at
the GPU's dense matmul rate (``cost.non_expert_flops``), which is far from what a real step does:
through ``llamafactory-cli train`` on an H200 a DeepSeek-V2-Lite micro-batch of 2048 tokens with
every expert resident took 439 ms where the FLOPs at the dense rate said 159 ms for the whole
of it -- the non-expert work is bound by the host's per-kernel time (PEFT's LoRA layers, norms,
rotary embeddings) and attention, not by the matmul rate.

``measure_non_expert`` runs the model as the trainer will (train mode, its gradient
checkpointing, its attention implementation, its LoRA) on one micro-batch of random token ids,
forward + backward, with every routed-experts module (``KTExperts``) returning zeros, and times
it; the first call warms up (cuBLAS handles, allocator) and is not counted. The RNG is forked
(the run's dropout and data order are unchanged) and every gradient it made is dropped.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import NamedTuple

import torch

from kt_ft.base.log import get_logger
from kt_ft.runtime.experts import KTExperts

logger = get_logger(__name__)


@contextmanager
def routed_experts_skipped(model: torch.nn.Module):
    """Every ``KTExperts`` of ``model`` returns zeros inside the block (``KTExperts.skip_routed``)."""
    mods = [m for m in model.modules() if isinstance(m, KTExperts)]
    for m in mods:
        m.skip_routed = True
    try:
        yield mods
    finally:
        for m in mods:
            m.skip_routed = False


def _vocab_size(model: torch.nn.Module) -> int:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


class NonExpertRun(NamedTuple):
    """``measure_non_expert``'s result: seconds of the best timed call; the allocator's peak rise in
    bytes (CUDA) or None; the GPU's busy seconds in one more call (CUDA, where the profiler could
    tell) or None."""

    seconds: float
    peak_bytes: int | None
    gpu_seconds: float | None = None


def gpu_busy_seconds(fn) -> float | None:
    """Seconds the GPU spends in the kernels (and copies) ``fn()`` queues: their durations summed,
    as torch.profiler's CUDA activity records them. Why not the wall time: a host-bound pass leaves
    the GPU idle between kernels, and work queued beside it (CUDA graphs' replays) fills that idle
    time (``cost.LayerTimes.graphed``). None where the profiler records nothing."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        us = sum(e.self_device_time_total for e in prof.key_averages())
    except Exception as e:  # noqa: BLE001 -- no CUPTI, another profiler running: a figure lost, not the run
        logger.info(f"placement: auto: the GPU time of the non-expert work was not measured ({e})")
        return None
    return us / 1e6 if us > 0 else None


def measure_non_expert(
    model: torch.nn.Module,
    *,
    seq_len: int,
    batch: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    repeat: int = 2,
    gpu_time: bool = False,
) -> NonExpertRun:
    """Seconds and GPU memory of one micro-batch's forward + backward (``batch`` x ``seq_len`` token ids, int64,
    labels the same ids) of ``model`` with its routed experts skipped; the best of ``repeat``
    timed calls after one warm-up. ``device``: where the model's embeddings are (CUDA: each call
    is timed between two synchronisations); ``autocast_dtype``: the run's mixed precision (the
    Trainer's bf16 / fp16 autocast), None: none. ``NonExpertRun.peak_bytes``: CUDA only, the
    allocator's peak over what it held before the first call (activations, the loss, the
    non-expert LoRA's gradients); None elsewhere. ``gpu_time``: one more call under the profiler
    gives ``NonExpertRun.gpu_seconds`` (``gpu_busy_seconds``)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    vocab = _vocab_size(model)
    was_training = model.training
    trainable = [p for p in model.parameters() if p.requires_grad]
    had_grad = [p.grad for p in trainable]
    best = float("inf")
    gpu_s = None
    if cuda:
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.random.fork_rng(devices=[device] if cuda else []), routed_experts_skipped(model):
        model.train()
        try:
            ids = torch.randint(vocab, (batch, seq_len), device=device)

            def step() -> None:
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    out = model(input_ids=ids, labels=ids, use_cache=False)
                out.loss.backward()

            for i in range(repeat + 1):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize(device)
                if i:  # the first call warms up
                    best = min(best, time.perf_counter() - t0)
            gpu_s = gpu_busy_seconds(step) if cuda and gpu_time else None
        finally:
            for p, g in zip(trainable, had_grad, strict=True):
                p.grad = g  # the run's gradients as they were (None before the first step)
            model.train(was_training)
    peak = torch.cuda.max_memory_allocated(device) - held if cuda else None
    return NonExpertRun(best, peak, gpu_s)
