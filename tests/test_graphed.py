"""CUDA graphs of a resident layer's expert work (kt_ft/runtime/graphed.py) against the same layers run
eagerly (``KT_FT_CUDA_GRAPHS=0``): a tiny bf16 Qwen3-MoE, every expert resident, trained a few
AdamW steps with reentrant checkpointing (forward without grad, recompute, backward: the graphs'
path), without checkpointing (a forward with grad evicts the one before it), with non-reentrant
checkpointing (saved-tensor hooks: no graph for forwards with grad), and with micro-batches of
varied lengths (padded to their token-count bucket; buckets past ``MAX_BUCKETS`` eager). On the CPU
too: the buckets, and that padding rows change no result of the fused forward and backward.

Both runs take the same kernels in the same order (the padded ones more rows of zeros). Bounds: losses rel 1e-3 per step, expert
LoRA after the steps abs 2e-3 (bf16 model, fp32 LoRA, AdamW eps 1e-3: ``helpers.resident.adamw``).
The CUDA cases run on the GPU machine (sm90+: where every product is one grouped product); the CPU
checks run everywhere.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.parity import ATTN, expert_lora
from helpers.resident import kt_layers
from helpers.resident import train as train_on
from helpers.tiny_models import tiny_model

from kt_ft.plan.families import FAMILIES
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.runtime import graph_buckets, graph_capture, graphed
from kt_ft.runtime.patch import replace_routed_experts

RANK, ALPHA = 8, 16  # rank 8: bf16 LoRA rows of 16 bytes, which torch._grouped_mm takes
EVERY = (
    "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu, gpu_experts: 8}\n- default: {device: cuda}\n"
)
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs CUDA sm90+: runs on the GPU machine")


def build(rule_path, seed=0):
    """A tiny bf16 PEFT model (LoRA on attention), every routed expert resident, on CUDA."""
    from peft import LoraConfig, get_peft_model

    fam = FAMILIES["qwen3_moe"]
    model = tiny_model("qwen3_moe", seed=seed).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTN, lora_dropout=0.0))
    plan = make_plan(model, load_rules(rule_path), fam, "torch", 2)
    replace_routed_experts(model, plan, RANK, ALPHA / RANK, 4096, seed=seed + 1)
    with torch.no_grad():  # non-zero B: the expert LoRA contributes (and trains A) from step 0
        gen = torch.Generator().manual_seed(seed + 9)
        for m in kt_layers(model):
            for n in ("gate_b", "up_b", "down_b"):
                p = getattr(m, n)
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.device))
    return model.to("cuda")


def train(model, batches, steps, checkpointing):
    """``helpers.resident.train`` on CUDA; ``checkpointing``: None (off) or use_reentrant."""
    return train_on(model, batches, steps, checkpointing is not None, "cuda", bool(checkpointing))


def batches(lengths=(24,)):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, 97, (1, n), generator=gen) for n in lengths]


def run_both(tmp_path, monkeypatch, checkpointing, lengths=(24,), steps=4):
    """(eager losses, graphed losses, eager model, graphed model)."""
    rule = tmp_path / "every.yaml"
    rule.write_text(EVERY)
    graphed._workspaces.clear()
    monkeypatch.setenv("KT_FT_CUDA_GRAPHS", "0")
    eager = build(rule)
    ref = train(eager, batches(lengths), steps, checkpointing)
    monkeypatch.setenv("KT_FT_CUDA_GRAPHS", "1")
    model = build(rule)
    got = train(model, batches(lengths), steps, checkpointing)
    print(f"losses eager {ref}, graphed {got}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-3, atol=0)
    a, b = expert_lora(model), expert_lora(eager)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-3, msg=lambda m, k=k: f"{k}: {m}")
    assert all(m.device_experts.graphs.replays == 0 for m in kt_layers(eager))
    return model


@needs_sm90
def test_graphs_train_like_eager_under_reentrant_checkpointing(tmp_path, monkeypatch):
    """LLaMA-Factory's default: each layer's forward without grad, then its recompute and backward.
    From the second step on every pass of every layer is a replay (3 graphs a layer)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(graphed, "SEEN_BEFORE_CAPTURE", 1)  # captured in step 2
    model = run_both(tmp_path, monkeypatch, checkpointing=True, steps=4)
    layers = kt_layers(model)
    assert [m.device_experts.graphs.captures for m in layers] == [3, 3]
    # steps 2-4 replay the forward, the recompute and the backward: 3 passes x 3 steps
    assert [m.device_experts.graphs.replays for m in layers] == [9, 9]
    assert all(ws.keep_saved for ws in graphed._workspaces.values())


@needs_sm90
def test_graphs_without_checkpointing_evict_and_fall_back(tmp_path, monkeypatch):
    """Every forward before any backward: the second layer's forward with grad copies the first
    layer's tensors out of the shared buffers (whose backward then runs eagerly), and forwards with
    grad run eagerly from then on."""
    monkeypatch.setattr(graphed, "SEEN_BEFORE_CAPTURE", 1)
    model = run_both(tmp_path, monkeypatch, checkpointing=None, steps=3)
    assert [ws.keep_saved for ws in graphed._workspaces.values()] == [False]
    assert sum(m.device_experts.graphs.replays for m in kt_layers(model)) > 0


@needs_sm90
def test_no_graphs_for_forwards_under_saved_tensor_hooks(tmp_path, monkeypatch):
    """Non-reentrant checkpointing saves through its hooks in both passes: no graph replays."""
    monkeypatch.setattr(graphed, "SEEN_BEFORE_CAPTURE", 1)  # a capture would come in step 2
    model = run_both(tmp_path, monkeypatch, checkpointing=False, steps=3)
    assert [m.device_experts.graphs.replays for m in kt_layers(model)] == [0, 0]


@needs_sm90
def test_lengths_of_one_bucket_share_its_graphs(tmp_path, monkeypatch):
    """Micro-batches of 24, 40 and 56 tokens in turn: all in the 64-token bucket, so one set of
    graphs a layer (captured at the bucket's use SEEN_BEFORE_CAPTURE + 1), replayed with 40, 24
    and 8 padding rows, trains like eager."""
    model = run_both(tmp_path, monkeypatch, checkpointing=True, lengths=(24, 40, 56), steps=9)
    for m in kt_layers(model):
        buckets = {k[1] for k in m.device_experts.graphs.graphs if k[0] != "backward"}
        assert buckets == {64}, buckets
        # the forward, the recompute and the backward of every step after the eager ones
        assert m.device_experts.graphs.replays == 3 * (9 - graphed.SEEN_BEFORE_CAPTURE)


@needs_sm90
def test_graphs_for_at_most_max_buckets(tmp_path, monkeypatch):
    """Micro-batches of 24, 100 and 200 tokens (buckets 64, 112, 224) with room for two buckets:
    graphs for the first two, the third eager, the training the same as eager's."""
    monkeypatch.setattr(graphed, "MAX_BUCKETS", 2)
    monkeypatch.setattr(graphed, "SEEN_BEFORE_CAPTURE", 1)  # each length comes 3 times
    model = run_both(tmp_path, monkeypatch, checkpointing=True, lengths=(24, 100, 200), steps=9)
    for m in kt_layers(model):
        buckets = {k[1] for k in m.device_experts.graphs.graphs if k[0] != "backward"}
        assert buckets == {64, 112}, buckets


@needs_sm90
def test_a_failed_capture_leaves_the_callers_stream_and_trains_like_eager(tmp_path, monkeypatch):
    """A capture in which an op fails (here a host read of a device value, which a capture forbids)
    turns that layer's graphs off, logs that op's error and leaves the caller's stream current, not
    the side stream the capture ran on; the run then trains like eager."""
    monkeypatch.setattr(graphed, "SEEN_BEFORE_CAPTURE", 1)  # a capture in step 2
    body = graphed.LayerGraphs._forward_body

    def failing(self, x, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            x.sum().item()
        return body(self, x, *args, **kwargs)

    monkeypatch.setattr(graphed.LayerGraphs, "_forward_body", failing)
    stream = torch.cuda.current_stream()
    model = run_both(tmp_path, monkeypatch, checkpointing=True, steps=3)
    assert torch.cuda.current_stream() == stream
    for m in kt_layers(model):
        g = m.device_experts.graphs
        # the failing op's own error, not the invalidated capture's
        assert g.off is not None and g.off.startswith("capture failed at graphed.py:"), g.off
        assert "not permitted" in g.off, g.off
        assert g.replays == 0


def test_a_failure_names_the_innermost_frame_of_kt_fts_code():
    """A failed capture's log line says where it stopped (the innermost kt_ft frame of the error)
    and the error's first line."""
    with pytest.raises(RuntimeError) as info:
        graph_buckets.zero_rows_to(torch.zeros(3, 2), 1)  # fewer rows than it has: a negative size
    got = graph_capture.failure(info.value)
    first = str(info.value).splitlines()[0]
    assert re.fullmatch(r"at graph_buckets\.py:\d+ \(zero_rows_to\): " + re.escape(first[:200]), got), got
    assert graph_capture.failure(RuntimeError("raised nowhere\nmore")) == "at ?: raised nowhere"

    def outside():  # a frame outside the kt_ft package (whatever folder the checkout is in)
        raise RuntimeError("in the tests")

    with pytest.raises(RuntimeError) as info:
        outside()
    assert graph_capture.failure(info.value) == "at ?: in the tests"


def test_buckets_round_up_by_at_most_a_quarter():
    """Every count 1..5000 maps to a bucket no smaller and (past the 64 floor) at most 25% larger;
    powers of two stay; the buckets per power of two are four."""
    prev = 0
    for t in range(1, 5001):
        b = graph_buckets.bucket_tokens(t)
        assert b >= t and b >= prev, (t, b)
        if t > graph_buckets.MIN_BUCKET:
            assert b <= 1.25 * t, (t, b)
        prev = b
    assert [graph_buckets.bucket_tokens(t) for t in (64, 128, 1024, 2048)] == [64, 128, 1024, 2048]
    assert len({graph_buckets.bucket_tokens(t) for t in range(1025, 2049)}) == 4
    assert graph_buckets.bucket_tokens(1100) == 1280


@pytest.mark.parametrize("variant", ["plain", "gpt_oss"])
def test_padding_rows_change_no_result(variant):
    """What a replay of a bucket computes: ``fused_forward`` / ``fused_backward`` on the call's rows
    padded (``pad_rows``, a zero incoming gradient for the padding) against the unpadded call, on
    the CPU in float32, fresh random routing and weights (gpt_oss: biased, clamped experts, so a
    padding row's expert output is not zero). Bound: 1e-5 of each tensor's largest entry (only the
    order of float sums differs)."""
    from helpers.moe_inputs import routed_problem

    from kt_ft.backends.grouped_device import fused_backward, fused_forward, stack_lora
    from kt_ft.backends.grouped_products import Groups

    T, E, k, H = 9, 6, 2, 32
    base, lora, x, ids, w, grad, seed = routed_problem(T, E, k, H, 16, 4, variant)

    def call(x, ids, w, grad):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        groups = Groups(torch.bincount(flat, minlength=E), flat.numel())
        out, saved, meta = fused_forward(
            x,
            w,
            tuple(lora),
            base,
            2.0,
            groups,
            order,
            k,
            lambda *t: stack_lora(*t, torch.float32, base.spec),
        )
        return (out, *fused_backward(grad, saved, meta, True, True))

    ref = call(x, ids, w, grad)
    tb = 16
    xp, ip, wp = graph_buckets.pad_rows(x, ids, w, tb, E)
    assert xp.shape == (tb, H) and ip.shape == (tb, k) and wp.shape == (tb, k)
    assert torch.equal(xp[:T], x) and torch.equal(ip[:T], ids) and not wp[T:].any()
    gp = torch.cat([grad, grad.new_zeros(tb - T, H)])
    out, *grads = call(xp, ip, wp, gp)
    got = (out[:T], *graph_buckets.unpad_grads(tuple(grads), T))
    names = ["out", "x", "weights", "gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"]
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert err <= 1e-5, f"{name}: {err:.2e} of its largest entry (seed {seed})"


@needs_sm90
def test_a_gpu_memory_cap_forbids_graphs(tmp_path, monkeypatch):
    monkeypatch.setenv("KT_FT_CUDA_GRAPHS", "1")
    monkeypatch.setattr(graphed, "_forbidden", "kt_gpu_memory=12: test")
    rule = tmp_path / "every.yaml"
    rule.write_text(EVERY)
    model = build(rule)
    train(model, batches(), 3, True)
    assert all(m.device_experts.graphs.replays == 0 for m in kt_layers(model))
    assert all(m.device_experts.graphs.off == "kt_gpu_memory=12: test" for m in kt_layers(model))


def test_saved_tensor_hooks_seen_as_checkpointing_sets_them():
    """Reentrant checkpointing: no hooks in either pass (the recompute runs plainly under grad);
    non-reentrant: hooks in both, so the decision is the same in the forward and its recompute."""
    import torch.utils.checkpoint as cp

    seen = []

    def fn(x):
        seen.append((torch.is_grad_enabled(), graphed.saved_tensor_hooks_active()))
        return x * x

    x = torch.randn(3, requires_grad=True)
    cp.checkpoint(fn, x, use_reentrant=True).sum().backward()
    assert seen == [(False, False), (True, False)]
    seen.clear()
    cp.checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert seen == [(True, True), (True, True)]


def test_layers_on_the_cpu_device_run_eagerly(tmp_path, monkeypatch):
    """Where the "GPU" is the CPU (no CUDA), the graphs stand aside: no capture, no replay."""
    from helpers.resident import build as build_fp32

    monkeypatch.setenv("KT_FT_CUDA_GRAPHS", "1")

    rule = tmp_path / "every.yaml"
    rule.write_text(EVERY.replace("gpu_experts: 8", "gpu_experts: 8, backend: torch"))
    model = build_fp32(rule)
    if torch.cuda.is_available():
        pytest.skip("the CPU-device case: machines without CUDA")
    ids = batches()[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(m.device_experts.graphs is not None for m in kt_layers(model))
    assert all(m.device_experts.graphs.captures == 0 for m in kt_layers(model))


def test_a_graphed_layer_writes_the_wide_lora_blocks_once_per_change(monkeypatch):
    """``LayerGraphs._load_lora`` (outside the graphs, so it runs on the CPU too; in grad mode, as a
    forward without checkpointing calls it): the first call writes the LoRA into the wide buffers; calls with unchanged parameters write nothing; an
    optimizer step (``lora_changed``), an in-place change of a parameter, or a new copy of the
    buffers (zero LoRA blocks) writes again -- always the parameters' current values."""
    from types import SimpleNamespace

    from helpers.moe_inputs import make_problem

    from kt_ft.backends import grouped_device as gd
    from kt_ft.backends.base import lora_changed
    from kt_ft.backends.grouped_wide import WideExperts

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    E, H, I, r = 3, 32, 16, 8
    base, lora, *_ = make_problem(4, E, 2, H, I, r, torch.float32, gen)
    lora = [t.clone().requires_grad_() for t in lora]  # parameters, written in grad mode as a run does
    wide = WideExperts.from_weights(base.gate_up, base.down, r, base.spec, "cpu")
    dev = SimpleNamespace(resident=SimpleNamespace(weights=SimpleNamespace(wide=wide)))
    lg = graphed.LayerGraphs(dev, scaling=2.0)
    writes = []
    orig = WideExperts.load_lora
    monkeypatch.setattr(WideExperts, "load_lora", lambda self, *a: writes.append(1) or orig(self, *a))

    def holds_lora(w):
        a_gu, b_gu, ad, bd = gd.stack_lora(*lora, torch.float32, base.spec)
        return torch.equal(w.a_gu, a_gu) and torch.equal(w.b_gu, b_gu * 2.0) and torch.equal(w.b_d, bd * 2.0)

    lg._load_lora(lora)
    lg._load_lora(lora)  # a recompute, the next micro-batch: nothing changed
    assert len(writes) == 1 and holds_lora(wide)
    assert not wide.gu_buf.requires_grad and not wide.d_buf.requires_grad  # a plain write, not a graph node
    with torch.no_grad():  # the optimizer's step: in place, then its post-step hook
        lora[1].add_(0.5)
    lora_changed()
    lg._load_lora(lora)
    assert len(writes) == 2 and holds_lora(wide)
    with torch.no_grad():  # in place outside any optimizer: the version counter tells
        lora[5].mul_(3.0)
    lg._load_lora(lora)
    assert len(writes) == 3 and holds_lora(wide)
    fresh = WideExperts.from_weights(base.gate_up, base.down, r, base.spec, "cpu")
    dev.resident.weights.wide = fresh  # the resident experts copied again: zero LoRA blocks
    lg._load_lora(lora)
    assert len(writes) == 4 and holds_lora(fresh)
