"""Before any weight is read (``kt_ft/runtime/preload.py``): a run whose host RAM need exceeds what
this machine has available stops in seconds, saying need, have and what would fit; one that fits
only by evicting page cache gets a warning line (``kt_ft/plan/report.py`` ``check_host_fit``)."""

import math
import time

import pytest
from transformers import AutoConfig

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.recipe import KTConfig
from kt_ft.runtime.preload import host_memory, prepare_loading

GIB = 2**30


def _report(param: int, state: int = 0, act: int = 0, runtime: int = 0) -> dict:
    total = param + state + act + runtime
    return {
        "devices": {
            "cpu": {
                "param_bytes": param,
                "train_state_bytes": state,
                "activation_bytes": act,
                "runtime_bytes": runtime,
                "total_bytes": total,
            }
        }
    }


def test_host_fit_refuses_warns_and_passes():
    from kt_ft.plan.report import check_host_fit

    report = _report(param=30 * GIB, state=GIB, act=GIB)  # 32 GiB, 28 of them routed experts
    kw = {"where": "recipe.yaml", "expert_bytes": 28 * GIB, "quantized": False}
    with pytest.raises(KTConfigError) as err:
        check_host_fit(report, total=24 * GIB, available=22 * GIB, free=20 * GIB, **kw)
    msg = str(err.value)
    for part in (
        "recipe.yaml",
        "needs 32.00 GiB of host RAM",
        "routed experts 28.00 GiB",
        "24.00 GiB",
        "22.00 GiB",
    ):
        assert part in msg, (part, msg)
    assert "kt-ft quantize --format int8" in msg and "about 18.00 GiB" in msg  # 32 - 28 / 2
    # already quantized: no quantize advice, the other ways still named
    with pytest.raises(KTConfigError) as err:
        check_host_fit(report, total=24 * GIB, available=22 * GIB, free=20 * GIB, **{**kw, "quantized": True})
    assert "kt-ft quantize" not in str(err.value) and "cutoff_len" in str(err.value)
    # fits, but only by evicting page cache: a warning line, not a refusal
    warning = check_host_fit(report, total=64 * GIB, available=40 * GIB, free=30 * GIB, **kw)
    assert warning is not None and "only by evicting page cache" in warning
    # fits with little headroom
    warning = check_host_fit(report, total=64 * GIB, available=34 * GIB, free=34 * GIB, **kw)
    assert warning is not None and "little headroom" in warning
    assert check_host_fit(report, total=128 * GIB, available=100 * GIB, free=90 * GIB, **kw) is None


def test_a_model_larger_than_this_machine_is_refused_before_any_weight_is_read(tmp_path):
    """A Qwen3-MoE-shaped config with routed experts of 1.5 x this machine's RAM (bf16), and no
    weight file at all: ``prepare_loading`` refuses it from the config alone, in seconds."""
    total, available, _ = host_memory()
    if not total:
        pytest.skip("no /proc/meminfo here")
    keys = _big_config(total)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=1000, **keys)
    layers = keys["num_hidden_layers"]
    per_layer = keys["num_experts"] * 3 * keys["hidden_size"] * keys["moe_intermediate_size"] * 2
    config.save_pretrained(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(KTConfigError) as err:
        prepare_loading(
            config,
            str(tmp_path),
            KTConfig(threads=1),
            training_device="cpu",
            single_device=True,
            source="big.yaml",
        )
    seconds = time.perf_counter() - t0
    msg = str(err.value)
    print(
        f"{layers} layers, {per_layer * layers / GIB:.1f} GiB of experts, refused in {seconds:.1f} s: {msg}"
    )
    assert seconds < 30
    assert msg.startswith("kt-ft: big.yaml: this run needs ") and "of host RAM" in msg
    assert "kt-ft quantize --format int8" in msg
    assert not list(tmp_path.glob("*.safetensors"))  # nothing was there to read, nothing was read


def _big_config(total: int, layers_at_least: int = 1) -> dict:
    """Qwen3-MoE keys whose bf16 routed experts take 1.5 x ``total`` bytes (dims kept small enough
    that the meta skeleton builds in a second)."""
    experts, hidden, inter = 128, 2048, 768
    per_layer = experts * 3 * hidden * inter * 2
    return {
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": inter,
        "num_experts": experts,
        "num_local_experts": experts,  # the name the demo's config.json carries
        "num_experts_per_tok": 8,
        "num_hidden_layers": max(layers_at_least, math.ceil(1.5 * total / per_layer)),
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
    }


def _write_sparse_shards(model_dir, config: dict) -> int:
    """One safetensors shard per layer holding that layer's routed experts in bf16 (HF v5's fused
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]), written shard by shard: a real header,
    the data region a hole (a sparse file: no disk, no RAM). Returns the bytes the shards declare."""
    import json
    import struct

    e, h, i = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    weight_map, declared = {}, 0
    for layer in range(config["num_hidden_layers"]):
        name = f"model-{layer:05d}.safetensors"
        prefix = f"model.layers.{layer}.mlp.experts"
        shapes = {f"{prefix}.gate_up_proj": [e, 2 * i, h], f"{prefix}.down_proj": [e, h, i]}
        header, offset = {}, 0
        for key, shape in shapes.items():
            size = math.prod(shape) * 2
            header[key] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[key] = name
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(model_dir / name, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + offset)
        declared += offset
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": declared}, "weight_map": weight_map})
    )
    return declared


@pytest.mark.lf_subprocess
def test_llamafactory_refuses_a_checkpoint_larger_than_this_machine(demo_assets, tmp_path):
    """``llamafactory-cli train`` with ``use_kt`` on a checkpoint whose routed experts alone are
    1.5 x this machine's RAM (written shard by shard, sparse): refused before any weight is read,
    with kt-ft's message, not killed by the kernel's OOM killer mid-load."""
    import json
    import shutil

    from helpers.lf_runs import finish, start_train

    pytest.importorskip("llamafactory")
    total, _, _ = host_memory()
    if not total:
        pytest.skip("no /proc/meminfo here")
    big = tmp_path / "big"
    shutil.copytree(demo_assets / "model", big, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((big / "config.json").read_text())
    config.update(_big_config(total))
    (big / "config.json").write_text(json.dumps(config))
    declared = _write_sparse_shards(big, config)
    t0 = time.perf_counter()
    rc, log = finish(start_train(demo_assets, tmp_path / "out", model_name_or_path=big), timeout=300)
    seconds = time.perf_counter() - t0
    print(
        f"{declared / GIB:.1f} GiB of experts in {config['num_hidden_layers']} shards; rc {rc} after {seconds:.1f} s"
    )
    assert rc != 0, log[-3000:]
    assert "this run needs" in log and "of host RAM" in log and "kt-ft quantize --format int8" in log, log[
        -3000:
    ]
    assert "routed-experts modules" not in log  # neither of kt-ft's two "loading ..." lines: no load began
    assert sum(f.stat().st_blocks for f in big.glob("*.safetensors")) * 512 < 2**30  # the shards stay holes
