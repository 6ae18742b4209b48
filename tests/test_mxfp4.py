"""gpt-oss's MXFP4 routed experts read as distributed (``kt_ft/quant``, format ``mxfp4``).

The tiny checkpoint is made here: a random gpt_oss (the family's demo shapes: 8 experts, H 64,
I 32, biases past the clamp limit) saved in bf16 and quantized by ``kt-ft quantize --format mxfp4``
into gpt-oss's hub layout (``gate_up_proj_blocks`` [E, 2I, H/32, 16], ``_scales`` [E, 2I, H/32],
the same for ``down_proj``, biases bf16).

Independent references: transformers' own MXFP4 code (``convert_moe_packed_tensors``, and
``from_pretrained`` with ``Mxfp4Config(dequantize=True)``, which dequantizes the same bytes and
runs its own GptOss model), the bit-by-bit twin of ``kt_ft/backends/quant_reference.py``, and a hand-packed
byte. Training parity: kt-ft's MXFP4 model (torch and reference backends; resident and streamed
experts on the CPU as the "device") against transformers' dequantized model with the expert LoRA
folded into its weights (W + s B A in fp32): loss rel 1e-5, and the gradients of every other
trainable tensor and of the expert LoRA (the latter from transformers' weight gradients by the
chain rule) within 1e-5 of their largest entry (fp32; folding the LoRA rounds once more than
adding it, and the summation orders differ: measured ~1e-7). Dequantizers: bitwise (fp4 values
times a power of two are exact in fp32 and bf16). Seeds are printed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import tiny_model
from safetensors import safe_open

from kt_ft.backends import quant_reference as R
from kt_ft.backends.quant import FORMATS
from kt_ft.backends.quant_detect import detect_format, take_quantization_config
from kt_ft.backends.quant_weights import QuantizedExperts
from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.cli.main import main as cli
from kt_ft.plan.families import FAMILIES

mxfp4_module = pytest.importorskip("transformers.integrations.mxfp4")

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
SEED = 0
F = FORMATS["mxfp4"]
EXPERTS = "model.layers.{}.mlp.experts"


# --- the format against transformers' dequantizer ---------------------------------------------


def test_dequantize_equals_transformers_and_the_twin():
    """Random packed bytes (every code, scales 2^-20..2^20) and quantized random weights: kt-ft's
    vectorised dequantize == the bit-decoding twin == transformers' ``convert_moe_packed_tensors``
    of the same bytes, stacked as [E, out, in/32, 16] (which transformers returns as [E, in, out],
    the bf16 gpt_oss layout), bitwise."""
    gen = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    num, out, inp = 3, 48, 96
    blocks = torch.randint(0, 256, (num, out, inp // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(107, 148, (num, out, inp // 32), generator=gen, dtype=torch.uint8)
    hf = mxfp4_module.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert hf.shape == (num, inp, out)
    for e in range(num):
        parts = {"blocks": blocks[e], "scales": scales[e]}
        got = F.dequantize(parts, torch.float32)
        assert torch.equal(got, hf[e].t()), e
        assert torch.equal(got, R.dequantize("mxfp4", parts)), e
        assert torch.equal(F.dequantize(parts, torch.bfloat16).float(), got), e  # exact in bf16


def test_a_hand_packed_byte():
    """Byte 0x2F: low nibble 0xF (element 0) = -6, high nibble 0x2 (element 1) = +1.0; byte 0x91:
    1 -> +0.5, 9 -> -0.5; scale 128 multiplies by 2, scale 126 by 1/2."""
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[:, 0, 0], blocks[:, 0, 1] = 0x2F, 0x91
    scales = torch.tensor([[128], [126]], dtype=torch.uint8)
    want = torch.zeros(2, 32)
    want[0, :4] = torch.tensor([-6.0, 1.0, 0.5, -0.5]) * 2
    want[1, :4] = torch.tensor([-6.0, 1.0, 0.5, -0.5]) / 2
    parts = {"blocks": blocks, "scales": scales}
    assert torch.equal(F.dequantize(parts, torch.float32), want)
    assert torch.equal(R.dequantize("mxfp4", parts), want)


def test_quantize_round_trips_and_refuses_partial_groups():
    """quantize -> dequantize: every value of the fp4 grid is kept exactly, the relative error on
    gaussian weights stays within fp4's (~0.12), and an input size that is not a whole number of
    groups of 32 is refused (the files keep no shape)."""
    gen = torch.Generator().manual_seed(SEED)
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6]).repeat(4, 2) * 0.25
    assert torch.equal(F.dequantize(F.quantize(grid), torch.float32), grid)
    w = torch.randn(64, 128, generator=gen) * 0.02
    rel = ((F.dequantize(F.quantize(w), torch.float32) - w).norm() / w.norm()).item()
    assert rel < 0.15, rel
    with pytest.raises(ValueError, match="in=70 is not a multiple of 32"):
        F.quantize(torch.randn(4, 70, generator=gen))


def test_detected_from_config_and_listed_as_supported(tmp_path):
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    assert detect_format({"quantization_config": qc}) is F
    with pytest.raises(KTConfigError, match=r"mxfp4 \(fp4 e2m1"):
        detect_format({"quantization_config": {"quant_method": "gptq"}}, tmp_path / "config.json")


# --- the tiny checkpoint ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """A tiny random gpt_oss in bf16 and its ``kt-ft quantize --format mxfp4`` copy."""
    root = tmp_path_factory.mktemp("mxfp4")
    tiny_model("gpt_oss", seed=SEED).to(torch.bfloat16).save_pretrained(root / "bf16")
    assert cli(["quantize", str(root / "bf16"), str(root / "mxfp4"), "--format", "mxfp4"]) == 0
    return root


def _hf_dequantized(model_dir, dtype=torch.float32):
    """transformers' own load of the MXFP4 checkpoint, dequantized by transformers."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=Mxfp4Config(dequantize=True), dtype=dtype
    )
    return model.to(dtype)


def test_quantize_writes_gpt_oss_hub_layout(oss):
    """The files hold what the hub checkpoints hold (uint8 blocks [E, 2I, H/32, 16], scales
    [E, 2I, H/32]; down [E, H, I/32, 16]; biases bf16; no bf16 expert weight), config.json says
    ``quant_method: mxfp4``, and --format mxfp4 on another family is refused naming it."""
    cfg = json.loads((oss / "mxfp4" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(oss / "mxfp4" / "model.safetensors", "pt") as f:
        shapes = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    key = EXPERTS.format(1)
    assert shapes[f"{key}.gate_up_proj_blocks"] == ((8, 64, 2, 16), "U8")
    assert shapes[f"{key}.gate_up_proj_scales"] == ((8, 64, 2), "U8")
    assert shapes[f"{key}.down_proj_blocks"] == ((8, 64, 1, 16), "U8")
    assert shapes[f"{key}.down_proj_scales"] == ((8, 64, 1), "U8")
    assert shapes[f"{key}.gate_up_proj_bias"] == ((8, 64), "BF16")
    assert f"{key}.gate_up_proj" not in shapes and f"{key}.down_proj" not in shapes
    tiny_model("qwen3_moe").to(torch.bfloat16).save_pretrained(oss / "qwen")
    with pytest.raises(KTConfigError, match="model_type='qwen3_moe'; --format mxfp4 .* valid formats"):
        from kt_ft.integrations.export.quantize import quantize_checkpoint

        quantize_checkpoint(oss / "qwen", oss / "qwen_mx", "mxfp4")


def test_a_wrong_scale_shape_names_the_tensor_and_file(oss, tmp_path):
    """A stored tensor of another shape (scales of a 64-wide group) stops the load before any
    expert is read, naming the tensor, its file, what it is and what the format wants."""
    from safetensors.torch import load_file, save_file

    from kt_ft.formats.skeleton import meta_model
    from kt_ft.runtime.quant_loading import find_quantized_sources

    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(oss / "mxfp4" / "model.safetensors")
    key = f"{EXPERTS.format(1)}.gate_up_proj_scales"
    tensors[key] = torch.zeros(8, 64, 1, dtype=torch.uint8)
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((oss / "mxfp4" / "config.json").read_text())
    config = tiny_model("gpt_oss").config
    names = [EXPERTS.format(i) for i in range(2)]
    with pytest.raises(KTConfigError) as err:
        find_quantized_sources(bad, meta_model(config, torch.bfloat16), names, F)
    msg = str(err.value)
    assert key in msg and str(bad / "model.safetensors") in msg and "U8 [8, 64, 1]" in msg, msg
    assert "uint8 [8, 64, 2]" in msg, msg


def _load(model_dir, backend="torch", dtype=torch.float32):
    """kt-ft's loader + KTExperts (rank 4, alpha 8: s = 2), expert LoRA B random, every float
    parameter trainable (the router and embeddings get gradients through the routing weights and
    the experts' input)."""
    from transformers import AutoConfig

    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.loader import load_rules
    from kt_ft.runtime.loading import load_planned, planned_device_map
    from kt_ft.runtime.patch import replace_routed_experts

    config = AutoConfig.from_pretrained(model_dir)
    take_quantization_config(config)
    fam = FAMILIES["gpt_oss"]
    dm, plan = planned_device_map(config, load_rules(resolve_rule_path("gpt_oss")), fam, backend, 1, "cpu")
    model = load_planned(model_dir, dm, plan, dtype=dtype)
    summary = replace_routed_experts(model, plan, rank=4, scaling=2.0, chunk_size=16, seed=SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("_b"):  # expert LoRA B starts at zero: make it count
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            if p.is_floating_point() and not n.endswith(("_proj_bias", "_proj")):
                p.requires_grad_(True)
    return model, summary


def test_loaded_experts_are_transformers_dequantization(oss):
    """kt-ft holds each layer's experts as MXFP4 QuantizedExperts in gpt_oss's layout ([E, H, 2I] /
    [E, I, H], the stored bytes only) whose dequantization equals the weights transformers' own
    MXFP4 load gives (bitwise); the biases are the file's."""
    model, summary = _load(oss / "mxfp4")
    ref = _hf_dequantized(oss / "mxfp4")
    assert summary.base_format == "mxfp4"
    for i, layer in enumerate(model.model.layers):
        kt, hf = layer.mlp.experts, ref.model.layers[i].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            q = getattr(kt, name)
            assert isinstance(q, QuantizedExperts) and q.fmt is F and q.transposed
            assert q.shape == getattr(hf, name).shape
            assert torch.equal(q.dequantize_all(torch.float32), getattr(hf, name).float()), (i, name)
            assert {t.dtype for t in q.leaves()} == {torch.uint8}
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            assert torch.equal(getattr(kt, name), getattr(hf, name).float()), (i, name)
    assert summary.expert_bytes == sum(
        m.mlp.experts.gate_up_proj.nbytes() + m.mlp.experts.down_proj.nbytes() + 4 * (8 * 64 + 8 * 64)
        for m in model.model.layers
    )


# --- training against transformers -------------------------------------------------------------


def _tokens():
    return torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(SEED + 2))


def _loss_and_grads(model):
    ids = _tokens()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _reference(oss, kt_model, s=2.0):
    """(loss, grads) of transformers' dequantized model with each layer's expert LoRA of
    ``kt_model`` folded into its weights, gate/up columns interleaved as gpt_oss stores them:
    gate_up[e][:, 0::2] += (s Bg Ag)^T, [:, 1::2] += (s Bu Au)^T, down[e] += (s Bd Ad)^T. The
    expert-LoRA gradients come from transformers' weight gradients M by the chain rule:
    dA = s B^T M^T, dB = s M^T A^T (M the [in, out] gradient of the columns a LoRA feeds)."""
    ref = _hf_dequantized(oss / "mxfp4")
    loras = {}
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            kt, hf = kt_model.model.layers[i].mlp.experts, layer.mlp.experts
            lora = {
                n: getattr(kt, n).detach().clone()
                for n in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")
            }
            loras[i] = lora
            for e in range(hf.gate_up_proj.shape[0]):
                hf.gate_up_proj[e][:, 0::2] += (s * lora["gate_b"][e] @ lora["gate_a"][e]).T
                hf.gate_up_proj[e][:, 1::2] += (s * lora["up_b"][e] @ lora["up_a"][e]).T
                hf.down_proj[e] += (s * lora["down_b"][e] @ lora["down_a"][e]).T
    for p in ref.parameters():
        p.requires_grad_(True)
    loss, grads = _loss_and_grads(ref)
    want = {}
    for n, g in grads.items():
        if n.endswith("_proj_bias"):
            continue  # frozen in kt-ft
        if not n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            want[n] = g
            continue
        i = int(n.split(".")[2])
        lora, prefix = loras[i], n.rpartition(".")[0]
        cols = {"gate": g[..., 0::2], "up": g[..., 1::2]} if n.endswith("gate_up_proj") else {"down": g}
        for proj, m in cols.items():
            a, b = lora[f"{proj}_a"], lora[f"{proj}_b"]
            want[f"{prefix}.{proj}_a"] = s * b.transpose(1, 2) @ m.transpose(1, 2)
            want[f"{prefix}.{proj}_b"] = s * m.transpose(1, 2) @ a.transpose(1, 2)
    return loss, want


def _assert_matches(loss, got, want_loss, want, what):
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (what, loss, want_loss)
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys())[:6])
    for n, g in got.items():
        tol = 1e-5 * want[n].abs().max().item() + 1e-12
        err = (g - want[n]).abs().max().item()
        assert err <= tol, (what, n, err, tol)


@pytest.mark.parametrize("placement", ["cpu:torch", "cpu:reference", "resident", "streamed"])
def test_training_matches_transformers(oss, placement):
    """Loss and gradients (expert LoRA, router, attention, embeddings) of kt-ft's MXFP4 model equal
    transformers' dequantized model with the LoRA folded in (module doc): the CPU op on the torch
    and reference backends; experts 0, 3, 5 resident on the "device" (the CPU here, as
    tests/test_resident.py does) and the rest on the CPU op; experts 1, 2, 6 streamed through one
    stream buffer for both layers (so the backward fetches them back), expert 0 resident. Every
    dequantization is one expert's projection."""
    from kt_ft.runtime.streamed import StreamScheduler

    print(f"seed {SEED}")
    backend = placement.partition(":")[2] or "torch"
    model, summary = _load(oss / "mxfp4", backend)
    assert summary.backend == backend
    moe = [layer.mlp.experts for layer in model.model.layers]
    if placement == "resident":
        for m in moe:
            m.set_placement((0, 3, 5), (), torch.device("cpu"))
            assert isinstance(m.resident.weights.gate_up, QuantizedExperts)
    if placement == "streamed":
        sched = StreamScheduler(num_slots=1)
        for m in moe:
            m.scheduler = sched
            m.set_placement((0,), (1, 2, 6), torch.device("cpu"))
    want_loss, want = _reference(oss, model)
    shapes = []
    orig = F.dequantize

    def record(parts, dtype):
        w = orig(parts, dtype)
        shapes.append(tuple(w.shape))
        return w

    F.dequantize = record
    try:
        loss, got = _loss_and_grads(model)
    finally:
        F.dequantize = orig
    assert shapes and set(shapes) <= {(64, 64), (64, 32)}, set(shapes)  # gate_up [2I, H], down [H, I]
    if placement == "streamed":
        assert sched.copies_by["backward"] >= 1, sched.stats()
    _assert_matches(loss, got, want_loss, want, placement)


def test_experts_interface_dispatch_reads_mxfp4_experts(oss):
    """``experts_implementation='kt_ft'`` (``kt-ft models``' check) on experts kept MXFP4 takes
    gpt_oss's layout from the module: logits equal transformers' dequantized model (fp32, 1e-5 of
    the largest logit)."""
    from transformers import AutoConfig

    from kt_ft.plan.builtin import resolve_rule_path
    from kt_ft.plan.loader import load_rules
    from kt_ft.runtime.dispatch import use_kt_ft_experts
    from kt_ft.runtime.loading import load_planned, planned_device_map

    config = AutoConfig.from_pretrained(oss / "mxfp4")
    take_quantization_config(config)
    dm, plan = planned_device_map(
        config, load_rules(resolve_rule_path("gpt_oss")), FAMILIES["gpt_oss"], "torch", 1, "cpu"
    )
    model = load_planned(oss / "mxfp4", dm, plan, dtype=torch.float32)
    use_kt_ft_experts(model)
    ref = _hf_dequantized(oss / "mxfp4")
    with torch.no_grad():
        got, want = model(input_ids=_tokens()).logits, ref(input_ids=_tokens()).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


# --- dequantize, manifest and merge --------------------------------------------------------------


def test_dequantize_gives_a_bf16_gpt_oss_transformers_loads(oss, tmp_path):
    """``kt-ft dequantize``: a plain bf16 gpt_oss checkpoint whose expert weights are transformers'
    own dequantization of the MXFP4 files (bitwise) and every other tensor the quantized files'
    (bitwise); transformers loads it with nothing missing or unexpected."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bf16"
    assert cli(["dequantize", str(oss / "mxfp4"), str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["kt_ft_dequantized_from"]["format"] == "mxfp4"
    plain, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = _hf_dequantized(oss / "mxfp4", torch.bfloat16)
    got, want = plain.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k].to(got[k].dtype)), k


def test_manifest_records_mxfp4_and_merge_refuses_it(tmp_path, capsys):
    """Through LLaMA-Factory (PEFT LoRA on attention, kt-ft's expert LoRA): the gpt_oss demo
    quantized to MXFP4 loads with its experts kept MXFP4, the saved manifest says
    ``experts.base_format: mxfp4``, merge onto it is refused with the reason and the options, and
    merge onto its ``kt-ft dequantize`` copy works."""
    pytest.importorskip("llamafactory")
    from helpers.quant import assert_quantized_adapter_round_trip

    from kt_ft.integrations.demo.text import make_demo_model

    assets = make_demo_model(tmp_path / "demo", family="gpt_oss")
    merged = assert_quantized_adapter_round_trip(assets, "mxfp4", tmp_path, capsys)
    assert detect_format(json.loads((merged / "config.json").read_text())) is None


# --- plans and memory ---------------------------------------------------------------------------

GPT_OSS_20B = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12,
    torch_dtype="bfloat16",
    quantization_config=F.quantization_config(),
)


def test_rules_plan_counts_mxfp4_experts_as_stored(tmp_path, capsys):
    """gpt-oss-20b's config with its MXFP4 experts, from config.json alone: the CPU holds each
    expert weight's stored bytes (half a byte a weight + a byte per 32), by hand from the shapes,
    and the experts' biases in bf16; everything else is counted as for the same config in bf16."""

    def plan(config):
        d = tmp_path / config.get("quantization_config", {}).get("quant_method", "bf16")
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        capsys.readouterr()
        assert (
            cli(["rules", "plan", "--rule", "gpt_oss", "--model", str(d), "--cpu-infer", "16", "--json"]) == 0
        )
        return json.loads(capsys.readouterr().out)

    mx = plan(GPT_OSS_20B)
    bf16 = plan({k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"})
    assert mx["expert_format"] == "mxfp4" and bf16["expert_format"] is None
    weights = 24 * 32 * 3 * 2880 * 2880  # gate, up, down per expert
    stored = weights // 2 + weights // 32
    cpu_mx, cpu_bf16 = mx["devices"]["cpu"]["param_bytes"], bf16["devices"]["cpu"]["param_bytes"]
    print(f"gpt-oss-20b experts in RAM: mxfp4 {cpu_mx / 2**30:.2f} GiB, bf16 {cpu_bf16 / 2**30:.2f} GiB")
    assert cpu_bf16 - cpu_mx == 2 * weights - stored


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
def test_loading_mxfp4_peaks_below_the_bf16_experts(tmp_path):
    """Loading an MXFP4 gpt_oss (32 experts of H 512, I 512, 2 layers: 96 MiB of experts in
    bf16, 25.5 MiB stored) in a fresh process: the experts are QuantizedExperts, and the peak RSS
    growth stays below the experts' bf16 size and within 1.1 x their stored bytes + the rest +
    48 MiB (the bound tests/test_quant.py holds fp8 to)."""
    from helpers.quant import assert_quantized_load_peak

    assert_quantized_load_peak(
        tmp_path, "mxfp4", "gpt_oss", hidden_size=512, intermediate_size=512, num_local_experts=32
    )


@pytest.mark.lf_subprocess
def test_lr0_losses_through_llamafactory_cli_match_the_dequantized_copy(tmp_path):
    """``llamafactory-cli train`` (use_kt) on the gpt_oss demo quantized to MXFP4 (experts read and
    kept MXFP4) and on its ``kt-ft dequantize --dtype fp32`` copy (dense experts): the same losses at
    lr 0 (the same model every step), rel 1e-5 (fp32), over 2 steps. The reference is kt-ft's dense
    path (checked against transformers + PEFT in tests/test_parity.py): use_kt: false cannot load a
    gpt_oss here (LLaMA-Factory 0.9.5's gpt-oss attention set-up needs a transformers function 5.6
    does not have; kt-ft works around it only with use_kt)."""
    pytest.importorskip("llamafactory")
    from helpers.lf_runs import LOSS_RTOL, finish, start_train, step_losses

    from kt_ft.integrations.demo.text import make_demo_model

    assets = make_demo_model(tmp_path / "demo", family="gpt_oss")
    q, plain = tmp_path / "mxfp4", tmp_path / "fp32"
    assert cli(["quantize", str(assets / "model"), str(q), "--format", "mxfp4"]) == 0
    assert cli(["dequantize", str(q), str(plain), "--dtype", "fp32"]) == 0
    common = dict(learning_rate=0.0, max_steps=2, save_steps=10)
    losses = {}
    for name, model_dir in (("mxfp4", q), ("dense", plain)):
        rc, log = finish(start_train(assets, tmp_path / name, model_name_or_path=model_dir, **common))
        assert rc == 0, log[-4000:]
        losses[name] = step_losses(tmp_path / name)
    assert (
        "routed experts: " in (tmp_path / "mxfp4.log").read_text()
        and "of mxfp4" in (tmp_path / "mxfp4.log").read_text()
    )  # kt-ft's quantized reader ran
    got, want = losses["mxfp4"], losses["dense"]
    print(f"losses MXFP4 {got}, dequantized copy {want}")
    assert sorted(got) == sorted(want) == [1, 2]
    for step in got:
        assert abs(got[step] - want[step]) <= LOSS_RTOL * abs(want[step]), (step, got[step], want[step])
