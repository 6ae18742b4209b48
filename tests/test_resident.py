"""GPU-resident experts (``gpu_experts``, kt_ft/runtime/resident.py), checked on the CPU: the "GPU"
device is the CPU, so the split of each layer's pairs between the device part and the CPU op
runs exactly as on a GPU machine (tests/test_gpu.py's twin below runs it on CUDA).

Tolerances (fp32), against the all-CPU placement (the same pairs summed in another order):
first-step gradients of every trainable tensor 2e-6 relative to its largest entry (measured
5e-7), losses rel 1e-5 per step, expert-LoRA tensors after 4 AdamW steps abs 1e-4 (AdamW's eps
raised to 1e-3: ``helpers.resident.adamw`` says why); kernels with masked pairs vs the
reference with those pairs' weights zeroed: 2e-5 relative to the largest entry (tests/test_kernels.py's
fp32 bound).
"""

from __future__ import annotations

import pytest
import torch
from helpers.moe_inputs import GPT_OSS_SPEC, make_problem
from helpers.parity import expert_lora
from helpers.resident import (
    GPU_RULE,
    RANK,
    batches,
    build,
    call_spy,
    first_grads,
    kt_layers,
    train,
    train_keep,
)
from helpers.tiny_models import tiny_model

from kt_ft.backends.base import ExpertWeights, LoraTensors
from kt_ft.backends.reference import ReferenceBackend
from kt_ft.backends.registry import BACKENDS
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.homes import pick_resident_ids
from kt_ft.runtime.experts import KTExperts


@pytest.fixture()
def gpu_rule(tmp_path):
    p = tmp_path / "gpu.yaml"
    p.write_text(GPU_RULE)
    return p


@pytest.fixture()
def cpu_home_rule(tmp_path):
    """GPU_RULE with the CPU as the training device, on every machine: the "resident" experts and
    their LoRA stay on the CPU where a GPU is present too (CI has none, and there ``cuda`` resolves
    to the CPU: the same run on both)."""
    p = tmp_path / "gpu-cpu-home.yaml"
    p.write_text(GPU_RULE.replace("- default: {device: cuda}", "- default: {device: cpu}"))
    return p


@pytest.mark.parametrize("gc", [False, True])
def test_resident_experts_train_like_all_cpu(cpu_home_rule, gc):
    cpu_model = build(resolve_rule_path("qwen3_moe-torch"))
    res_model = build(cpu_home_rule)
    layers = kt_layers(res_model)
    assert [m.resident.ids for m in layers] == [(0, 1, 2), (1, 6)]
    sd_names = set(res_model.state_dict())
    assert sd_names == set(cpu_model.state_dict())  # no new parameters or buffers

    first = [first_grads(m, gc) for m in (cpu_model, res_model)]
    assert first[0].keys() == first[1].keys() and any("experts.up_a" in n for n in first[0])
    for n, g in first[0].items():
        torch.testing.assert_close(
            first[1][n], g, rtol=0, atol=2e-6 * g.abs().max().item(), msg=lambda m, n=n: f"{n}: {m}"
        )
    for m in (cpu_model, res_model):
        m.zero_grad(set_to_none=True)
    ref = train(cpu_model, batches(), 4, gc)
    got = train(res_model, batches(), 4, gc)
    # the CPU op still runs once per layer per step (the reentrant recompute takes its stash)
    assert [m.runner.forward_calls for m in layers] == [5, 5]  # 1 (first grads) + 4
    assert [m.runner.stash_hits for m in layers] == [5 if gc else 0] * 2
    # the device experts' LoRA rows cross once per step, not again for the recompute
    assert [m.device_experts.lora_copies for m in layers] == [5, 5]
    assert all(m.device_experts._lora_dev is None for m in layers)  # the backward freed them
    assert got[-1] < got[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    a, b = expert_lora(res_model), expert_lora(cpu_model)
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=0, atol=1e-4, msg=k)
    # the resident experts' LoRA did train (through the device path only)
    m = layers[1]
    init = build(cpu_home_rule)
    assert not torch.equal(m.gate_a[6], kt_layers(init)[1].gate_a[6])
    assert set(res_model.state_dict()) == sd_names


@pytest.mark.parametrize("split", ["every", "mixed"])
def test_lora_on_the_device_trains_like_all_cpu(gpu_rule, tmp_path, monkeypatch, split):
    """Expert LoRA living on the training device (``placement/homes.py`` ``lora_home``; the "device" is
    the CPU here, forced): with every expert on the device the LoRA rows are used in place (no
    copy, no host mirror); with CPU experts too (``mixed``) the CPU op reads a host mirror
    refreshed once per step (the recompute reuses it). Both train like all-CPU, with
    checkpointing, within test_resident_experts_train_like_all_cpu's bounds."""
    from kt_ft.runtime import patch as patch_mod

    rule = gpu_rule
    if split == "every":
        rule = tmp_path / "every.yaml"
        rule.write_text(GPU_RULE.replace("[{layers: 1, ids: [1, 6]}, {count: 3}]", "8"))
    cpu_model = build(resolve_rule_path("qwen3_moe-torch"))  # LoRA on the CPU (the default)
    assert not any(m.lora_on_device for m in kt_layers(cpu_model))
    cpu = torch.device("cpu")  # the "device" (on a GPU machine too: the plan's device is CUDA there)
    monkeypatch.setattr(patch_mod, "lora_home", lambda device, all_on_device, **kw: cpu)
    dev_model = build(rule)
    layers = kt_layers(dev_model)
    assert all(m.lora_on_device for m in layers) and "lora_device=cpu" in repr(layers[0])
    ref = train(cpu_model, batches(), 4, True)
    got = train(dev_model, batches(), 4, True)
    assert [m.device_experts.lora_copies for m in layers] == [0, 0]
    if split == "every":
        assert [m.runner.forward_calls for m in layers] == [0, 0]
        assert all(m._host_lora is None for m in layers)
    else:
        assert [m.host_lora_copies for m in layers] == [4, 4]  # once a step, not again for the recompute
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    a, b = expert_lora(dev_model), expert_lora(cpu_model)
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=0, atol=1e-4, msg=k)


def test_lora_gradients_return_for_the_cpu_experts_rows_only(gpu_rule, monkeypatch):
    """``_LoraToHost``'s backward sends the CPU op's LoRA gradient back for the CPU experts' rows
    (the device experts' rows are the device path's: zero from the CPU op), on fresh random
    gradients: equal there (bitwise: a copy), zero elsewhere."""
    from kt_ft.runtime import patch as patch_mod
    from kt_ft.runtime.experts import _LoraToHost

    monkeypatch.setattr(patch_mod, "lora_home", lambda device, all_on_device, **kw: torch.device("cpu"))
    m = kt_layers(build(gpu_rule))[1]
    dev = m.device_experts
    assert m.lora_on_device and dev.cpu_follows
    params = [p for p in m.lora_tensors()]
    mirrors = _LoraToHost.apply(m, *params)
    grads = [torch.randn_like(t) for t in mirrors]
    got = torch.autograd.grad(mirrors, params, grads)
    cpu_rows = dev.cpu_ids()
    assert sorted(cpu_rows.tolist() + list(dev.ids)) == list(range(m.num_experts))
    for g, ref in zip(got, grads):
        assert torch.equal(g[cpu_rows], ref[cpu_rows])
        assert not g[list(dev.ids)].any()


def test_lora_home_is_the_gpu_only_for_layers_with_gpu_experts_in_one_process(monkeypatch):
    from kt_ft.plan.homes import lora_home

    cuda = torch.device("cuda", 0)
    assert lora_home(cuda, True) == cuda
    assert lora_home(cuda, False) is None  # every expert on the CPU: the LoRA stays beside them
    assert lora_home(torch.device("cpu"), True) is None
    monkeypatch.setenv("WORLD_SIZE", "2")  # expert-LoRA grads are averaged over gloo on the CPU
    assert lora_home(cuda, True) is None


def test_resident_pairs_are_not_sent_to_the_cpu(gpu_rule, monkeypatch):
    model = build(gpu_rule)
    seen = []
    layer = kt_layers(model)[0]
    orig = layer.runner.forward

    def spy(x, ids, weights, lora, needs_grad):
        seen.append(ids.clone())
        return orig(x, ids, weights, lora, needs_grad)

    monkeypatch.setattr(layer.runner, "forward", spy)
    model(input_ids=batches()[0])
    ids = seen[0]
    assert ((ids < 0) | (ids > 2)).all() and (ids < 0).any()  # experts 0-2 of layer 0: masked


def test_device_work_is_queued_before_the_cpu_op_blocks(gpu_rule, monkeypatch):
    """Forward: CPU-op input copies started, resident share queued, then the CPU op; backward: the
    resident share's backward (which starts the CPU op's gradient copy) before the CPU op's."""
    from kt_ft.runtime import device_experts as resident_mod

    model = build(gpu_rule)
    layer = kt_layers(model)[1]
    calls = []
    spy = call_spy(monkeypatch, calls)
    spy(layer.runner, "prefetch", "prefetch inputs")
    spy(layer.device_experts, "start", "queue resident")
    spy(layer.runner, "forward", "cpu forward")
    spy(resident_mod, "prefetch_grad_out", "resident backward")
    spy(layer.runner, "backward", "cpu backward")
    ids = batches()[0]
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    # layer 0's resident backward comes after layer 1's CPU backward: keep layer 1's part
    assert calls[:5] == [
        "prefetch inputs",
        "queue resident",
        "cpu forward",
        "resident backward",
        "cpu backward",
    ]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_routing_weights_get_gradients_from_both_parts(family):
    """KTExperts alone, float64: d out / d (x, weights, LoRA) with resident experts equals the
    all-CPU module's (torch backend), also at the resident slots (the router trains through them);
    gpt_oss: transposed, interleaved, biased, clamped experts (resident.py reads the spec). Bound:
    1e-10 relative / 1e-12 absolute (float64, different summation order)."""
    from kt_ft.backends.grouped import GroupedTorchBackend
    from kt_ft.plan.family import expert_spec

    torch.manual_seed(0)
    hf = tiny_model(family).model.layers[0].mlp.experts.double()
    spec = expert_spec(FAMILIES[family], hf)
    mods = [
        KTExperts(
            hf, layer_idx=0, rank=RANK, scaling=2.0, backend=GroupedTorchBackend(), chunk_size=4096, threads=None,
            lora_dtype=torch.float64, generator=torch.Generator().manual_seed(1), spec=spec, resident_ids=ids,
        )
        for ids in ((), (2, 5))
    ]  # fmt: skip
    for m in mods:
        with torch.no_grad():
            for n in ("gate_b", "up_b", "down_b"):
                getattr(m, n).copy_(
                    torch.randn(getattr(m, n).shape, generator=torch.Generator().manual_seed(3))
                )
    t, k, e = 11, 2, mods[0].num_experts
    x = torch.randn(t, mods[0].hidden_dim, dtype=torch.float64)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    w = torch.rand(t, k, dtype=torch.float64)
    assert torch.isin(ids, torch.tensor([2, 5])).any()
    grads = []
    for m in mods:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = m(xi, ids, wi)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append([out.detach(), xi.grad, wi.grad, *(p.grad for p in m.lora_tensors())])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("variant", ["plain", "gpt_oss"])
def test_backends_skip_masked_pairs(backend, variant):
    """Pairs with id -1 are skipped: same output, input and LoRA grads as the reference with those
    pairs' weights zeroed; their routing-weight grad is 0, the others' match."""
    gen = torch.Generator().manual_seed(11)
    extra = {"spec": GPT_OSS_SPEC, "bias_scale": 0.5} if variant == "gpt_oss" else {}
    base, lora, x, ids, w, _ = make_problem(37, 6, 3, 16, 8, 4, torch.float32, gen, **extra)
    s = 2.0
    masked = torch.rand(ids.shape, generator=gen) < 0.4
    masked[0] = True  # a token with every slot masked
    ids_m = ids.masked_fill(masked, -1)
    w_zero = w.masked_fill(masked, 0)

    def run(b, ids_, w_):
        out, ctx = b.forward(x, ids_, w_, base, lora, s, True)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
        return out, *b.backward(ctx, g)

    out, gx, gw, gl = run(BACKENDS[backend](), ids_m, w_zero)
    r_out, r_gx, r_gw, r_gl = run(ReferenceBackend(), ids, w_zero)

    def close(a, b):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5 * max(b.abs().max().item(), 1.0))

    close(out, r_out)
    close(gx, r_gx)
    assert (gw[masked] == 0).all()
    close(gw[~masked], r_gw[~masked])
    for a, b in zip(gl, r_gl):
        close(a, b)


def test_pick_resident_ids():
    assert pick_resident_ids(8, (5, 1), None) == (1, 5)
    assert pick_resident_ids(8, None, 3) == (0, 1, 2)
    assert pick_resident_ids(8, None, 0) == ()
    pop = torch.tensor([1, 9, 0, 9, 4, 0, 0, 2])
    assert pick_resident_ids(8, None, 3, pop) == (1, 3, 4)  # the most routed; ties: lower id


def test_checkpoint_holds_every_expert(cpu_home_rule, tmp_path):
    """The fused expert-LoRA file of a run with resident experts holds all experts of every layer
    and reads back into an all-CPU model unchanged."""
    from kt_ft.formats.expert_lora import FUSED_FILE, fused_header
    from kt_ft.runtime.adapter import load_fused_expert_lora, save_fused_expert_lora

    model = build(cpu_home_rule)
    train(model, batches(), 2, False)
    save_fused_expert_lora(model, tmp_path)
    header = fused_header(tmp_path / FUSED_FILE)
    assert len(header) == 2 * 6 and all(v["shape"][0] == 8 and v["dtype"] == "BF16" for v in header.values())
    other = build(resolve_rule_path("qwen3_moe-torch"), seed=3)
    assert load_fused_expert_lora(other, tmp_path) == 2
    a, b = expert_lora(model), expert_lora(other)
    for k in a:  # the training-dtype master copy: exact (the LoRA is homed on the GPU where one is present)
        torch.testing.assert_close(b[k].cpu(), a[k].cpu(), rtol=0, atol=0, msg=k)


def test_resume_under_another_placement(gpu_rule):
    """Train 2 steps with resident experts, move the state (weights + optimizer) to an all-CPU
    model, train 2 more: same as 4 uninterrupted all-CPU steps (losses rel 1e-5)."""
    ref = train(build(resolve_rule_path("qwen3_moe-torch")), batches(), 4, False)
    first = build(gpu_rule)
    opt_state = {}
    losses = train_keep(first, batches(), 0, 2, opt_state)
    second = build(resolve_rule_path("qwen3_moe-torch"))
    second.load_state_dict(first.state_dict())
    with torch.no_grad():
        for a, b in zip(kt_layers(first), kt_layers(second)):
            for x, y in zip(a.lora_tensors(), b.lora_tensors()):
                y.copy_(x)
    losses += train_keep(second, batches(), 2, 4, opt_state)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)


def test_resident_weights_are_plain_attributes(gpu_rule):
    model = build(gpu_rule)
    m = kt_layers(model)[0]
    model(input_ids=batches()[0])
    assert m.resident.device == torch.device("cpu") and m.resident.nbytes() > 0
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert not any("resident" in n for n in names)
    assert isinstance(m.resident.weights, ExpertWeights) and isinstance(m.lora_tensors(), LoraTensors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on the GPU machine")
@pytest.mark.parametrize("gc", [False, True])
def test_resident_experts_on_cuda_train_like_all_cpu(gpu_rule, gc):
    """The same on a real GPU: non-expert modules and the resident experts on CUDA (fp32, TF32 off):
    losses rel 1e-4, expert LoRA abs 1e-3 (test_gpu.py's bounds: GPU and CPU sum in other orders)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_model = build(resolve_rule_path("qwen3_moe-torch")).to("cuda")
    res_model = build(gpu_rule).to("cuda")
    ref = train(cpu_model, batches(), 4, gc, "cuda")
    from kt_ft.runtime.transfer import STAGING

    hits0 = STAGING.prefetch_hits
    got = train(res_model, batches(), 4, gc, "cuda")
    layers = kt_layers(res_model)
    assert all(m.resident.device.type == "cuda" for m in layers)
    # the base weights stay on the CPU; the LoRA of a layer with GPU experts lives on the GPU and
    # the CPU op reads its pinned mirror, refreshed once a step (4 steps)
    assert all(p.device.type == "cpu" for m in layers for p in m.base_parameters())
    assert all(p.device.type == "cuda" for m in layers for p in m.lora_tensors())
    assert [m.host_lora_copies for m in layers] == [4, 4]
    assert all(t.is_pinned() for m in layers for t in m._host_lora)
    assert [m.runner.forward_calls for m in layers] == [4, 4]
    # every CPU-op input and incoming gradient copy was started before the resident experts' work
    # (3 inputs per layer per forward, x2 with checkpointing's recompute, + 1 gradient per backward)
    assert STAGING.prefetch_hits - hits0 == 4 * 2 * ((3 * 2 if gc else 3) + 1)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)
    a, b = expert_lora(res_model), expert_lora(cpu_model)
    for k in a:
        # the LoRA of a layer with GPU experts lives on the GPU: compare on the CPU
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=0, atol=1e-3, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on the GPU machine")
def test_all_resident_layers_keep_their_lora_on_cuda(tmp_path):
    """Every expert resident: the expert LoRA lives on the GPU (``lora_home``), no row crosses the
    link, the optimizer steps it there; trains like all-CPU within the CUDA bounds above (with
    checkpointing), and the fused checkpoint still reads back into an all-CPU model."""
    from kt_ft.runtime.adapter import load_fused_expert_lora, save_fused_expert_lora

    torch.backends.cuda.matmul.allow_tf32 = False
    rule = tmp_path / "every.yaml"
    rule.write_text(GPU_RULE.replace("[{layers: 1, ids: [1, 6]}, {count: 3}]", "8"))
    cpu_model = build(resolve_rule_path("qwen3_moe-torch")).to("cuda")
    dev_model = build(rule).to("cuda")
    layers = kt_layers(dev_model)
    assert all(m.lora_on_device and m.gate_a.device.type == "cuda" for m in layers)
    ref = train(cpu_model, batches(), 4, True, "cuda")
    got = train(dev_model, batches(), 4, True, "cuda")
    assert [m.device_experts.lora_copies for m in layers] == [0, 0]
    assert [m.runner.forward_calls for m in layers] == [0, 0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)
    a, b = expert_lora(dev_model), expert_lora(cpu_model)
    for k in a:
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=0, atol=1e-3, msg=k)
    save_fused_expert_lora(dev_model, tmp_path / "ckpt")
    other = build(resolve_rule_path("qwen3_moe-torch"), seed=3)
    assert load_fused_expert_lora(other, tmp_path / "ckpt") == 2
    for k, v in expert_lora(other).items():
        torch.testing.assert_close(v, a[k].cpu(), rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("ids", [(1, 2, 5), tuple(range(8))], ids=["some", "every"])
def test_device_share_graphs_are_released_by_their_backward(ids):
    """Each layer's device-side graph (``moe/inner_graph.py``) is freed by that layer's backward: after
    the backward of two chained layers no tensor saved inside them is held while their output
    (and so the model's graph) still exists. A second backward through the same graph is refused
    with a message where a layer has an inner graph (some experts on the CPU); with every expert
    resident the share is on the model's graph itself, which autograd's own rules govern."""
    import weakref

    from kt_ft.backends.grouped import GroupedTorchBackend

    class Holder:
        def __init__(self, t):
            self.t = t

    hf = tiny_model().model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(1)
    mods = [
        KTExperts(
            hf,
            layer_idx=i,
            rank=4,
            scaling=2.0,
            backend=GroupedTorchBackend(),
            chunk_size=4096,
            threads=None,
            generator=gen,
            resident_ids=ids,
        )
        for i in (0, 1)
    ]
    x = torch.randn(9, 64, requires_grad=True)
    top = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=gen, requires_grad=True)
    refs = []

    def pack(t):
        h = Holder(t)
        refs.append(weakref.ref(h))
        return h

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        y = mods[1](mods[0](x, top, w), top, w)
    y.square().sum().backward()
    # y keeps the model's graph (and each layer's ctx) alive: a retained inner graph would still
    # hold its saved tensors here, as it did until the end of every backward
    assert refs and sum(r() is not None for r in refs) == 0
    loss = mods[1](mods[0](x, top, w), top, w).square().sum()
    loss.backward(retain_graph=True)  # the model's graph kept, the device share's is not
    if len(ids) == 8:  # no inner graph: retained with the model's
        loss.backward()
        return
    with pytest.raises(RuntimeError, match="second backward through the same graph is not supported"):
        loss.backward()
