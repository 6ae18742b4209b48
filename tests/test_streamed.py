"""Streamed experts (``stream``, kt_ft/runtime/streamed.py), checked on the CPU: the "GPU" device is the
CPU, so the three-way split of each layer's pairs (resident / streamed / CPU op), the two shared
device buffers, the schedule (prefetch, reuse, re-copy at backward) and the counters run as on a
GPU machine, with plain synchronous copies (the CUDA twins below run on the GPU machine).

Tolerances (fp32) against the all-CPU placement, test_resident.py's and for its reasons: first-step
gradients 2e-6 relative to each tensor's largest entry, losses rel 1e-5 per step, expert LoRA after
the AdamW steps abs 1e-4 (helpers.resident.adamw: eps 1e-3); float64 single-layer gradients 1e-10 relative / 1e-12 absolute.

Copies (a model of L streamed layers, two buffers): the first step copies every layer in its forward
(the order is not known yet, so nothing is prefetched) and L-2 in its backward (the last two layers
are still buffered at the turn); every later step copies L-2 each way (the first two layers too are
still buffered from the previous backward): with or without checkpointing, since a checkpointed
layer's backward reuses the weights its recompute streamed (no third copy).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.parity import expert_lora
from helpers.resident import adamw, batches, build, first_grads, kt_layers, train, train_keep
from helpers.tiny_models import tiny_model

from kt_ft.backends.grouped_wide import wide_extra_bytes
from kt_ft.base.errors import KTConfigError
from kt_ft.plan.builtin import resolve_rule_path
from kt_ft.plan.families import FAMILIES
from kt_ft.plan.homes import pick_stream_ids
from kt_ft.plan.loader import load_rules
from kt_ft.plan.placement import make_plan
from kt_ft.plan.recipe import default_cpu_infer
from kt_ft.runtime.experts import KTExperts
from kt_ft.runtime.streamed import StreamScheduler, is_page_locked

LAYERS = 4  # MoE layers of the qwen3_moe model here: enough for the buffers to rotate and evict
# layer 1: 2 resident, 2 streamed by id, 4 on the CPU; the others: 2 resident, 3 streamed, 3 on the CPU
MIXED = (
    "- match: {{class: {cls}}}\n"
    "  replace:\n"
    "    device: cpu\n"
    "    backend: torch\n"
    "    gpu_experts: 2\n"
    "    stream: [{{layers: 1, ids: [3, 7]}}, {{count: 3}}]\n"
    "- default: {{device: cuda}}\n"
)
STREAM_ALL = "- match: {{class: {cls}}}\n  replace: {{device: cpu, backend: torch, stream: all}}\n"


def rule(tmp_path, text: str, family: str = "qwen3_moe"):
    p = tmp_path / f"{family}.yaml"
    p.write_text(text.format(cls=FAMILIES[family].experts_class))
    return p


def all_cpu(family="qwen3_moe", **kw):
    return build(resolve_rule_path(family), family=family, **kw)


def assert_trains_like(got_model, ref_model, got, ref, lora_atol=1e-4):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    a, b = expert_lora(got_model), expert_lora(ref_model)
    assert a.keys() == b.keys() and a
    for k in a:
        # .cpu(): a rule whose default device is cuda puts the LoRA of a streaming layer there
        # (``lora_home``) even when the test runs the model on the CPU
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=0, atol=lora_atol, msg=k)


def assert_same_first_grads(model, ref_model, gc=False):
    first = [first_grads(m, gc) for m in (ref_model, model)]
    assert first[0].keys() == first[1].keys() and any("experts.up_a" in n for n in first[0])
    for n, g in first[0].items():
        torch.testing.assert_close(
            first[1][n].cpu(), g.cpu(), rtol=0, atol=2e-6 * g.abs().max().item(), msg=n
        )
    for m in (model, ref_model):
        m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("gc", [False, True])
def test_resident_streamed_and_cpu_in_one_layer_train_like_all_cpu(tmp_path, gc):
    steps, L = 3, LAYERS
    cpu_model = all_cpu(num_hidden_layers=L)
    model = build(rule(tmp_path, MIXED), num_hidden_layers=L)
    layers = kt_layers(model)
    assert [(m.resident.ids, m.streamed.ids) for m in layers] == [((0, 1), (2, 3, 4)), ((0, 1), (3, 7))] + [
        ((0, 1), (2, 3, 4))
    ] * (L - 2)
    init_a7 = layers[1].gate_a[7].detach().clone()  # layer 1's streamed expert 7
    sched = layers[0].streamed.scheduler
    assert all(m.streamed.scheduler is sched for m in layers)  # one per model
    assert set(model.state_dict()) == set(cpu_model.state_dict())  # nothing new to save

    assert_same_first_grads(model, cpu_model, gc)
    assert sched.copies == L + (L - 2)  # first step: every layer forward, L-2 backward
    assert (
        sched.stats()["copies_by"].get("backward", 0) == 0
    )  # each backward found its layer (reuse/prefetch)

    per_step = []
    ref = train(cpu_model, batches(), steps, gc)
    opt = adamw(model)
    got = []
    model.train()
    for step in range(steps):
        before = sched.copies, [m.streamed.copies for m in layers]
        ids = batches()[step % 3]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
        per_step.append(
            (sched.copies - before[0], [m.streamed.copies - c for m, c in zip(layers, before[1])])
        )
    # later steps: L-2 copies each way; no layer copied more than twice a step (never for its backward)
    assert [n for n, _ in per_step] == [2 * (L - 2)] * steps
    assert all(max(c) <= 2 for _, c in per_step)
    assert "backward" not in sched.copies_by
    assert sched.prefetch_hits > 0 and sched.bytes_streamed == sum(m.streamed.bytes_streamed for m in layers)
    assert sched.bytes_streamed == sum(m.streamed.copies * m.streamed.nbytes for m in layers)
    # the CPU op still runs once per layer per step (checkpointing's recompute takes its stash)
    assert [m.runner.forward_calls for m in layers] == [1 + steps] * L
    assert [m.runner.stash_hits for m in layers] == [(1 + steps) if gc else 0] * L
    assert got[-1] < got[0]
    assert_trains_like(model, cpu_model, got, ref)
    # the streamed experts' LoRA did train (through the device path only)
    assert not torch.equal(layers[1].gate_a[7], init_a7)


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("deepseek_v2", MIXED),  # layer 0 dense: MoE layers 1-2
        ("gpt_oss", MIXED),  # transposed, interleaved, biased, clamped experts
        ("qwen3_moe", STREAM_ALL),
    ],
)
def test_families_train_like_all_cpu(tmp_path, family, text):
    """First-step gradients, 3 steps' losses and expert LoRA as the all-CPU placement. gpt_oss's
    LoRA bound is 1e-3: its clamps add near-zero gradient entries that AdamW amplifies (the
    resident-only placement, measured the same way, is 3.7e-4 off; the first-step gradients
    stay within 2e-6)."""
    ref_model = all_cpu(family)
    model = build(rule(tmp_path, text, family), family=family)
    layers = kt_layers(model)
    assert all(m.streamed is not None for m in layers)
    assert_same_first_grads(model, ref_model)
    ref = train(ref_model, batches(), 3, False)
    got = train(model, batches(), 3, False)
    assert_trains_like(model, ref_model, got, ref, 1e-3 if family == "gpt_oss" else 1e-4)


def test_stream_all_never_calls_the_cpu_op(tmp_path, monkeypatch):
    """``stream: all``: the whole layer on the device; no CPU op call (not even an empty one), in the
    first pass and the recompute of a checkpointed run, forward and backward."""
    from kt_ft.runtime import experts as experts_mod

    ref = train(all_cpu(), batches(), 2, True)
    model = build(rule(tmp_path, STREAM_ALL))
    calls = []

    class Spy:
        @staticmethod
        def apply(*a):
            calls.append("apply")
            raise AssertionError("CPU op called")

    monkeypatch.setattr(experts_mod, "CPUExpertsFunction", Spy)
    layers = kt_layers(model)
    assert all(m.streamed.ids == tuple(range(8)) and not m.device_experts.cpu_follows for m in layers)
    for m in layers:
        for name in ("forward", "forward_and_stash", "backward", "prefetch"):
            monkeypatch.setattr(m.runner, name, lambda *a, _n=name, **k: calls.append(_n))
    got = train(model, batches(), 2, True)
    assert calls == []
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)


def test_saved_weights_come_back_after_eviction():
    """One buffer for two layers: the first layer's weights are evicted by the second's forward, so
    its backward copies them again (the saved tensors are references, not the buffer's contents).
    float64, one KTExperts pair sharing a one-buffer scheduler vs the all-CPU pair."""
    from kt_ft.backends.grouped import GroupedTorchBackend

    torch.manual_seed(0)
    hf = [tiny_model().model.layers[i].mlp.experts.double() for i in range(2)]

    def pair(stream: bool):
        sched = StreamScheduler(num_slots=1)
        mods = [
            KTExperts(
                h, layer_idx=i, rank=4, scaling=2.0, backend=GroupedTorchBackend(), chunk_size=4096, threads=None,
                lora_dtype=torch.float64, generator=torch.Generator().manual_seed(i), stream_ids=(1, 2, 5, 6) if stream else (), scheduler=sched,
            )
            for i, h in enumerate(hf)
        ]  # fmt: skip
        for m in mods:
            with torch.no_grad():
                for n in ("gate_b", "up_b", "down_b"):
                    getattr(m, n).normal_(generator=torch.Generator().manual_seed(3))
        return mods, sched

    t, k = 13, 2
    x = torch.randn(t, 64, dtype=torch.float64)
    ids = [torch.stack([torch.randperm(8)[:k] for _ in range(t)]) for _ in range(2)]
    w = [torch.rand(t, k, dtype=torch.float64) for _ in range(2)]
    grads = []
    for stream in (False, True):
        mods, sched = pair(stream)
        xi = x.clone().requires_grad_()
        wi = [v.clone().requires_grad_() for v in w]
        h = mods[0](xi, ids[0], wi[0])
        out = mods[1](torch.tanh(h), ids[1], wi[1])
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append(
            [out.detach(), xi.grad, *(v.grad for v in wi), *(p.grad for m in mods for p in m.lora_tensors())]
        )
    assert sched.copies_by == {"forward": 2, "backward": 1}  # layer 0 back in for its backward
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_pick_stream_ids():
    assert pick_stream_ids(8, (0, 1), None, 3) == (2, 3, 4)  # the first non-resident ids
    assert pick_stream_ids(8, (0, 1), None, None) == (2, 3, 4, 5, 6, 7)  # all
    assert pick_stream_ids(8, (), (6, 2), None) == (2, 6)
    assert pick_stream_ids(8, (5,), None, 0) == ()
    pop = torch.tensor([9, 1, 9, 0, 4, 4, 0, 2])
    assert pick_stream_ids(8, (0,), None, 3, pop) == (2, 4, 5)  # most routed non-resident; ties: lower id
    with pytest.raises(ValueError, match=r"expert ids \[1\] are both resident"):
        pick_stream_ids(8, (0, 1), (1, 2), None)
    with pytest.raises(ValueError, match="stream count 7 > the 6 experts not resident"):
        pick_stream_ids(8, (0, 1), None, 7)


def test_stream_schema_errors_name_file_line_key_and_choices(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "- match: {class: Qwen3MoeExperts, layers: 0}\n"  # line 1
        "  replace: {device: cpu, stream: 'most'}\n"  # line 2: not a form
        "- match: {class: Qwen3MoeExperts, layers: 1}\n"  # line 3
        "  replace: {device: cpu, stream: {layers: 1}}\n"  # line 4: neither ids nor count
        "- match: {class: Qwen3MoeExperts, layers: 2}\n"  # line 5
        "  replace: {device: cpu, stream: [2, 2]}\n"  # line 6: repeated id
    )
    with pytest.raises(KTConfigError) as info:
        load_rules(bad)
    probs = info.value.problems
    assert len(probs) == 3, probs
    assert any(
        f"{bad}:2: [0].replace.stream: 'most' is not a streamed-expert selection; expected a count (4)" in p
        and "or 'all' (every expert of the layer not resident)" in p
        for p in probs
    )
    assert any(f"{bad}:4: [1].replace.stream: " in p and "give exactly one of ids, count" in p for p in probs)
    assert any(f"{bad}:6: [2].replace.stream: [2, 2] repeats an expert id" in p for p in probs)

    model = tiny_model(num_hidden_layers=4)  # 8 experts a layer
    plan_bad = tmp_path / "plan.yaml"
    plan_bad.write_text(
        "- match: {class: Qwen3MoeExperts, layers: 0}\n"  # line 1
        "  replace: {device: cpu, stream: [3, 9]}\n"
        "- match: {class: Qwen3MoeExperts, layers: 1}\n"  # line 3
        "  replace: {device: cpu, gpu_experts: [1, 2], stream: [2, 3]}\n"
        "- match: {class: Qwen3MoeExperts, layers: 2}\n"  # line 5
        "  replace: {device: cpu, gpu_experts: 5, stream: 4}\n"
        "- match: {class: Qwen3MoeExperts, layers: 3}\n"  # line 7: fine
        "  replace: {device: cpu, gpu_experts: 3, stream: all}\n"
    )
    with pytest.raises(KTConfigError) as info:
        make_plan(model, load_rules(plan_bad), FAMILIES["qwen3_moe"], "auto", 2)
    probs = info.value.problems
    assert len(probs) == 3, probs
    assert (
        f"{plan_bad}:1: stream: expert ids [9] do not exist in model.layers.0.mlp.experts; valid: 0-7"
        in probs
    )
    assert any(
        p.startswith(f"{plan_bad}:3: stream: expert ids [2] of model.layers.1.mlp.experts are both resident")
        for p in probs
    )
    assert (
        f"{plan_bad}:5: stream: gpu_experts 5 + stream 4 = 9 > the 8 experts of model.layers.2.mlp.experts; "
        "valid stream counts: 0-3 (or `stream: all`)" in probs
    )
    ok = tmp_path / "ok.yaml"
    ok.write_text(
        "- match: {class: Qwen3MoeExperts, layers: 3}\n  replace: {device: cpu, gpu_experts: 3, stream: all}\n"
        "- match: {class: Qwen3MoeExperts}\n  replace: {device: cpu}\n"
    )
    plan = make_plan(model, load_rules(ok), FAMILIES["qwen3_moe"], "auto", 2)
    (e,) = [e for e in plan.experts if e.stream_experts is not None]
    assert e.layer == 3 and e.stream_experts.is_all and e.gpu_experts.count == 3


def test_plan_report_counts_the_stream_buffers(tmp_path, capsys):
    from kt_ft.integrations.cli.main import main

    d = tmp_path / "m"
    tiny_model(num_hidden_layers=LAYERS).save_pretrained(d)
    r = rule(tmp_path, MIXED)
    assert main(["rules", "plan", "--rule", str(r), "--model", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    hows = [g["how"] for g in rep["groups"] if "routed experts" in g["what"]]
    cpu = f"cpu torch {default_cpu_infer()} threads"  # the rule gives no cpu_infer: this machine's default
    assert hows == [
        f"{cpu}, gpu_experts 2, stream 3",
        f"{cpu}, gpu_experts 2, stream ids [3, 7]",
        f"{cpu}, gpu_experts 2, stream 3",
    ]
    H, I, V = 64, 32, 97  # noqa: E741 - tiny_model's sizes (tests/test_rules_plan.py)
    per_expert = 3 * H * I * 4  # gate_up [2I, H] + down [H, I], fp32
    assert rep["stream"] == {
        "layers": LAYERS,
        "experts": 3 * (LAYERS - 1) + 2,
        "largest_layer_bytes": 3 * per_expert,
        "buffer_bytes": 2 * 3 * per_expert,  # double buffer: two layers' worth
        "bytes_per_pass": (3 * (LAYERS - 1) + 2) * per_expert,
    }
    per_layer = (64 * 64) + 2 * (64 * 32) + (64 * 64) + 2 * 16 + 2 * 64 + 8 * H
    non_expert = (2 * V * H + LAYERS * per_layer + H) * 4
    # a resident expert's copy holds the rank-8 expert LoRA's blocks beside it (grouped_wide.py)
    resident = per_expert + wide_extra_bytes(H, I, 8, 4)
    assert rep["devices"]["cuda:0"]["param_bytes"] == non_expert + LAYERS * 2 * resident + 2 * 3 * per_expert
    assert rep["devices"]["cpu"]["param_bytes"] == LAYERS * 8 * per_expert  # the CPU keeps every expert
    assert rep["devices"]["cpu"]["activation_bytes"] > 0  # the CPU op still has pairs
    assert main(["rules", "plan", "--rule", str(r), "--model", str(d)]) == 0
    assert "streamed experts: 11 in 4 layers" in capsys.readouterr().out
    assert main(["rules", "plan", "--rule", "qwen3_moe-stream", "--model", str(d), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["stream"]["experts"] == LAYERS * 8 and rep["stream"]["buffer_bytes"] == 2 * 8 * per_expert
    assert rep["devices"]["cpu"]["activation_bytes"] == 0  # `stream: all`: no CPU op


def test_resume_under_another_placement(tmp_path):
    """Train 2 steps all-CPU, save the checkpoint's expert LoRA (fused files) with the rest of the
    state, resume with experts resident, streamed and on the CPU in each layer: the same losses and
    expert LoRA as 4 uninterrupted all-CPU steps."""
    from kt_ft.runtime.adapter import load_fused_expert_lora, save_fused_expert_lora

    L = 3
    ref_model = all_cpu(num_hidden_layers=L)
    ref = train(ref_model, batches(), 4, False)
    first, opt_state = all_cpu(num_hidden_layers=L), {}
    losses = train_keep(first, batches(), 0, 2, opt_state)
    save_fused_expert_lora(first, tmp_path / "ckpt")
    other = {
        n: p.detach().clone() for n, p in first.named_parameters() if p.requires_grad and "experts" not in n
    }
    second = build(rule(tmp_path, MIXED), num_hidden_layers=L)  # the same base model
    with torch.no_grad():  # nothing of the expert LoRA left from the init: the checkpoint gives all of it
        for m in kt_layers(second):
            for p in m.lora_tensors():
                p.zero_()
    assert load_fused_expert_lora(second, tmp_path / "ckpt") == L
    with torch.no_grad():
        for n, p in second.named_parameters():
            if n in other:
                p.copy_(other[n])
    losses += train_keep(second, batches(), 2, 4, opt_state)
    assert kt_layers(second)[0].streamed.copies > 0
    assert_trains_like(second, ref_model, losses, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on the GPU machine")
def test_streamed_equals_resident_on_cuda():
    """The same experts streamed or resident: the same output and gradients on the GPU (same weights,
    same kernels: bitwise expected; 1e-6 allowed), and the streamed rows' RAM is page-locked."""
    from kt_ft.backends.grouped import GroupedTorchBackend

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_model().model.layers[0].mlp.experts
    ids = (1, 2, 5)
    mods = [
        KTExperts(hf, layer_idx=0, rank=4, scaling=2.0, backend=GroupedTorchBackend(), chunk_size=4096, threads=None,
                  generator=torch.Generator().manual_seed(1), **kw)
        for kw in ({"resident_ids": ids}, {"stream_ids": ids})
    ]  # fmt: skip
    x = torch.randn(17, 64, device="cuda")
    top = torch.stack([torch.randperm(8)[:2] for _ in range(17)]).cuda()
    w = torch.rand(17, 2, device="cuda")
    res = []
    for m in mods:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = m(xi, top, wi)
        out.square().sum().backward()
        res.append([out.detach(), xi.grad, wi.grad, *(p.grad for p in m.lora_tensors())])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    s = mods[1].streamed
    rows = hf.gate_up_proj[1:6]
    assert s._pinned and is_page_locked(rows) and s.copies == 1
    s.close()
    assert not is_page_locked(rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs on the GPU machine")
@pytest.mark.parametrize("gc", [False, True])
def test_streamed_experts_on_cuda_train_like_all_cpu(tmp_path, gc):
    """On a real GPU (fp32, TF32 off): losses rel 1e-4 and expert LoRA abs 1e-3 against all-CPU
    (test_gpu.py's bounds); the copies go through the copy stream and prefetches are used."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_model = all_cpu(num_hidden_layers=LAYERS).to("cuda")
    model = build(rule(tmp_path, MIXED), num_hidden_layers=LAYERS).to("cuda")
    ref = train(ref_model, batches(), 3, gc, "cuda")
    got = train(model, batches(), 3, gc, "cuda")
    sched = kt_layers(model)[0].streamed.scheduler
    assert sched.device.type == "cuda" and sched.copy_stream is not None
    assert sched.prefetch_hits > 0 and "backward" not in sched.copies_by
    assert sched.copies == LAYERS + (LAYERS - 2) + 2 * (LAYERS - 2) * 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)
    a, b = expert_lora(model), expert_lora(ref_model)
    for k in a:
        # the LoRA of a layer with GPU experts lives on the GPU: compare on the CPU
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), rtol=0, atol=1e-3, msg=lambda m, k=k: f"{k}: {m}")


def test_split_changed_between_steps_trains_like_all_cpu(tmp_path):
    """``KTExperts.set_placement`` (the re-planner's call) between steps: streamed ids change, a
    layer stops streaming (its rows leave the scheduler, its buffer is freed for others), another
    starts; the CPU op's backend is prepared when experts come back to it. Same tolerances."""
    L = LAYERS
    cpu_model = all_cpu(num_hidden_layers=L)
    model = build(rule(tmp_path, MIXED), num_hidden_layers=L)
    layers = kt_layers(model)
    sched = layers[0].streamed.scheduler
    opt_state, ref_state = {}, {}
    data = batches()
    ref = train_keep(cpu_model, data, 0, 2, ref_state) + train_keep(cpu_model, data, 2, 4, ref_state)
    got = train_keep(model, data, 0, 2, opt_state)
    layers[0].set_placement((5,), ())  # stops streaming
    layers[1].set_placement((0, 1), (2, 6))  # other streamed ids
    layers[2].set_placement((), (0, 1, 2, 3, 4, 5, 6, 7))  # every expert on the device
    layers[3].set_resident((2, 3))  # streamed 2-4 -> 4 only
    assert layers[0].streamed is None and layers[0].resident.ids == (5,)
    assert layers[3].streamed.ids == (4,) and layers[3].resident.ids == (2, 3)
    assert set(sched.layers) == {1, 2, 3} and 0 not in sched.order
    assert all(s.layer != 0 for s in sched.slots)
    assert not layers[2].device_experts.cpu_follows
    calls = [m.runner.forward_calls for m in layers]
    got += train_keep(model, data, 2, 4, opt_state)
    assert [m.runner.forward_calls - c for m, c in zip(layers, calls)] == [2, 2, 0, 2]
    assert_trains_like(model, cpu_model, got, ref)
    # a layer built with every expert on the device never prepared its CPU backend; moved back
    # to the CPU it is prepared then
    m = kt_layers(build(rule(tmp_path, STREAM_ALL)))[0]
    assert not m.runner.prepared
    m.set_placement((), ())
    assert m.runner.prepared and m.device_experts is None and m.streamed is None


def test_run_summary_reports_the_schedulers_counters(tmp_path):
    """The end-of-training log line (``kt_ft/runtime/run_stats.py``) states the stream scheduler's counters
    as they are after a step, and says when nothing streams."""
    from kt_ft.runtime.run_stats import run_summary, stream_stats

    model = build(rule(tmp_path, MIXED), num_hidden_layers=LAYERS)
    ids = batches()[0]
    model(input_ids=ids, labels=ids).loss.backward()
    sched = kt_layers(model)[0].streamed.scheduler
    assert stream_stats(model) == sched.stats() and sched.copies == 2 * LAYERS - 2
    line = run_summary(model, steps=1)
    assert (
        f"in {sched.copies} copies ({sched.copies:.1f} a step; forward {sched.copies_by['forward']}" in line
    )
    assert f"{sched.hits} uses found their layer" in line
    cpu = all_cpu(num_hidden_layers=2)
    other = run_summary(cpu, steps=1)
    assert (
        other.startswith("GPU allocator") if torch.cuda.is_available() else other.startswith("host: peak RSS")
    )
    # where host memory went: each CPU layer's backward state is one set, back in its free list
    # after the backward, and the report sums them
    cpu(input_ids=ids, labels=ids).loss.backward()
    sets = [m.runner.backend.host_bytes() for m in kt_layers(cpu)]
    assert [n for n, _ in sets] == [1, 1] and all(b > 0 for _, b in sets), sets
    line = run_summary(cpu, steps=1)
    assert "CPU op backward state" in line and "in 2 sets" in line, line
