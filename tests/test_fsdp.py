"""FSDP2 with kt-ft, on the CPU: 2 gloo processes against 1, and the engines kt-ft refuses.

accelerate 1.11 runs FSDP only on GPUs (on a CPU-only multi-process run it drops the FSDP
plugin and trains with DDP); ``tests/fsdp_on_cpu/sitecustomize.py`` lifts exactly that gate for
the training subprocesses, so the HF Trainer, accelerate's ``fully_shard`` wrapping and kt-ft's
FSDP2 path run as on GPUs (torch's ``fully_shard`` itself works over gloo).

Runs (``runs``: two waves of two concurrent subprocesses, the demo recipe, fp32):
  fsdp2       2 processes x batch 1 x accumulation 2, FSDP2 (``fsdp: full_shard auto_wrap``,
              ``fsdp_config: {fsdp_version: 2}``: one FSDP unit per decoder layer),
              max_grad_norm 0.5 (below the demo's gradient norms: clipping acts), checkpoint-2
  one         1 process x batch 4, same max_grad_norm
  fsdp2_resume  FSDP2 again from fsdp2/checkpoint-2 to step 4, this time through
              ``accelerate launch --config_file recipes/accelerate/fsdp2.yaml`` (LLaMA-Factory then
              switches to non-reentrant gradient checkpointing)
  fsdp2_to_one  1 process from fsdp2/checkpoint-2 to step 4 (an FSDP2 checkpoint is an ordinary one)

Tolerances as for DDP (``lf_runs.LOSS_RTOL`` / ``TENSOR_RTOL``: losses 1e-5 relative, tensors
1e-4 x max |ref|, bf16 file 1e-2); seen 2026-12-03: losses 2e-7, PEFT adapter 3e-6, expert LoRA
2e-5 (the same as DDP's).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.lf_runs import RECIPE, REPO, assert_close_runs, failure_text, finish, start_train, torchrun_env

from kt_ft.base.errors import KTConfigError

SHIM = REPO / "tests" / "fsdp_on_cpu"
FSDP2_KEYS = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2}}  # as the README says
ACCELERATE_CONFIG = REPO / "recipes" / "accelerate" / "fsdp2.yaml"


def fsdp2_recipe(path, **keys):
    """The demo recipe plus FSDP keys (a YAML file: nested keys cannot go on the command line)."""
    import yaml

    recipe = yaml.safe_load(RECIPE.read_text())
    recipe.update(keys or FSDP2_KEYS)
    path.write_text(yaml.safe_dump(recipe))
    return path


def fsdp_env(procs: int) -> dict[str, str]:
    path = os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")])
    return {**torchrun_env(procs), "PYTHONPATH": path}


# ----- engines kt-ft refuses (parsed in-process, nothing loaded) -----


def _args(demo_assets, tmp_path, **keys):
    from helpers.lf_recipe import recipe

    return recipe(demo_assets, tmp_path, **keys)


LAUNCH_ENV = (
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "FSDP_VERSION",
    "FSDP_CPU_RAM_EFFICIENT_LOADING",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher settings in the environment, and the environment restored afterwards (HF's
    TrainingArguments writes FSDP_CPU_RAM_EFFICIENT_LOADING into it)."""
    saved = dict(os.environ)
    for k in LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_deepspeed_in_the_recipe_is_refused_before_parsing(demo_assets, tmp_path, clean_env):
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args

    with pytest.raises(KTConfigError) as info:
        get_train_args(_args(demo_assets, tmp_path, deepspeed="examples/deepspeed/ds_z3_config.json"))
    msg = str(info.value)
    assert "deepspeed='examples/deepspeed/ds_z3_config.json' with use_kt: DeepSpeed is not supported" in msg
    assert "DDP" in msg and "FSDP2" in msg  # what is supported


def test_deepspeed_from_accelerate_launch_is_refused(demo_assets, tmp_path, clean_env):
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args

    clean_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(KTConfigError, match=r"accelerate config \(distributed_type: DEEPSPEED"):
        get_train_args(_args(demo_assets, tmp_path))


@pytest.mark.parametrize(
    "fsdp_config,shown",
    [({}, "fsdp_config.fsdp_version=1 (HF's default)"), ({"fsdp_version": 1}, "fsdp_config.fsdp_version=1")],
)
def test_fsdp1_in_the_recipe_is_refused(demo_assets, tmp_path, clean_env, fsdp_config, shown):
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args

    with pytest.raises(KTConfigError) as info:
        get_train_args(_args(demo_assets, tmp_path, fsdp="full_shard auto_wrap", fsdp_config=fsdp_config))
    msg = str(info.value)
    assert f"fsdp='full_shard auto_wrap' with {shown} with use_kt: FSDP version 1 is not supported" in msg
    assert "Set fsdp_version: 2" in msg


def test_fsdp1_from_accelerate_launch_is_refused(demo_assets, tmp_path, clean_env):
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args

    clean_env.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` exports for FSDP
    clean_env.setenv("FSDP_VERSION", "1")
    with pytest.raises(KTConfigError, match=r"distributed_type: FSDP, fsdp_version: 1.*FSDP version 1"):
        get_train_args(_args(demo_assets, tmp_path))


def test_fsdp2_cpu_ram_efficient_loading_is_refused(demo_assets, tmp_path, clean_env):
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args

    config = {**FSDP2_KEYS["fsdp_config"], "cpu_ram_efficient_loading": True}
    with pytest.raises(
        KTConfigError, match="fsdp_config.cpu_ram_efficient_loading=True with use_kt: not supported"
    ):
        get_train_args(_args(demo_assets, tmp_path, fsdp="full_shard auto_wrap", fsdp_config=config))


def test_fsdp2_recipe_parses(demo_assets, tmp_path, clean_env):
    pytest.importorskip("llamafactory")
    from llamafactory.hparams import get_train_args

    _, _, training_args, *_ = get_train_args(_args(demo_assets, tmp_path, **FSDP2_KEYS))
    assert training_args.fsdp_plugin_args["fsdp_version"] == 2


# ----- kt_ft.runtime.fsdp's helpers against one process (torchrun, 2 gloo ranks) -----


def test_fsdp_helpers_match_one_process():
    """clip_grad_norm_, full/shard_optimizer_state, copy_full_into, unfuse_mixed_groups on a model
    sharded by fully_shard beside an ignored parameter (tests/fsdp_helpers_worker.py says how)."""
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", str(REPO / "tests" / "fsdp_helpers_worker.py")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode == 0 and "fsdp helpers ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


# ----- llamafactory-cli train under FSDP2 against one process -----


@pytest.fixture(scope="module")
def runs(demo_assets, tmp_path_factory, one_process_run):
    pytest.importorskip("llamafactory")
    root = tmp_path_factory.mktemp("fsdp")
    recipe = fsdp2_recipe(root / "fsdp2.yaml")
    common = {"max_steps": 4, "save_steps": 2, "max_grad_norm": 0.5}
    fsdp2 = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "recipe": recipe}
    one = {"per_device_train_batch_size": 4}
    report = root / "memory"
    env = fsdp_env(2)
    logs = {}
    one_process_run.start()  # "one": trains beside "fsdp2"
    wave1 = {
        "fsdp2": start_train(
            demo_assets, root / "fsdp2", **common, **fsdp2, env={**env, "KT_FT_RUN_REPORT": report}
        ),
    }
    for name, proc in wave1.items():
        rc, logs[name] = finish(proc)
        assert rc == 0, failure_text(logs[name])
    one_dir, logs["one"] = one_process_run.wait()
    (root / "one").symlink_to(one_dir)
    ckpt = root / "fsdp2" / "checkpoint-2"
    wave2 = {
        "fsdp2_resume": start_train(
            demo_assets,
            root / "fsdp2_resume",
            **common,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=2,
            env={"PYTHONPATH": env["PYTHONPATH"]},
            accelerate=["--config_file", str(ACCELERATE_CONFIG), "--num_processes", "2"],
            resume_from_checkpoint=ckpt,
        ),
        "fsdp2_to_one": start_train(
            demo_assets, root / "fsdp2_to_one", **common, **one, resume_from_checkpoint=ckpt
        ),
    }
    for name, proc in wave2.items():
        rc, logs[name] = finish(proc)
        assert rc == 0, failure_text(logs[name])
    return root, logs


@pytest.mark.lf_subprocess
def test_fsdp2_matches_one_process_with_the_same_global_batch(runs):
    root, logs = runs
    log = logs["fsdp2"]
    assert "FSDP2: 2 routed-experts modules (16 params) go to fully_shard as ignored params" in log, log[
        -3000:
    ]
    # accelerate really sharded the rest, one unit per decoder layer (2) plus the root: the demo's 37
    # other parameters (embeddings, norms, attention, router, PEFT LoRA) are DTensors, the experts' 16
    # (frozen weights and LoRA) not
    assert "FSDP2 wrapped the model in 3 units: 37 parameters sharded (DTensor), 16 kept whole" in log
    assert "expert-LoRA gradients averaged across ranks 4 times this run" in log
    assert "shared by this machine's ranks: one MAP_SHARED copy" in log
    assert_close_runs(root / "fsdp2", root / "one", [1, 2, 3, 4])


@pytest.mark.lf_subprocess
@pytest.mark.parametrize("name", ["fsdp2_resume", "fsdp2_to_one"])
def test_fsdp2_checkpoint_resumes(runs, name):
    root, logs = runs
    assert "checkpoint-2" in logs[name] and "expert LoRA from" in logs[name]
    if name == "fsdp2_resume":  # through accelerate launch and its config file: FSDP2 all the same
        assert "FSDP2 wrapped the model in 3 units: 37 parameters sharded" in logs[name], logs[name][-3000:]
        assert "`use_reentrant_gc` has been set to False" in logs[name]
    assert_close_runs(root / name, root / "one", [1, 2, 3, 4])  # steps 1-2 from the checkpoint's history


@pytest.mark.lf_subprocess
def test_fsdp2_checkpoint_has_kt_ft_layout(runs):
    """Rank 0 writes the usual kt-ft files (whole tensors), not FSDP's distributed-checkpoint dirs."""
    from safetensors.torch import load_file

    from kt_ft.formats.manifest import verify_adapter_dir

    root, _ = runs
    ckpt = root / "fsdp2" / "checkpoint-2"
    manifest = verify_adapter_dir(ckpt)
    assert {
        "adapter_model.safetensors",
        "fused_expert_lora.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
    } <= set(manifest["files"])
    assert not list(ckpt.glob("pytorch_model_fsdp*")) and not list(ckpt.glob("optimizer_*"))
    got = load_file(str(ckpt / "adapter_model.safetensors"))
    want = load_file(str(root / "one" / "checkpoint-2" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}  # not shards
    state = torch.load(ckpt / "optimizer.pt", weights_only=False)["state"]
    one = torch.load(root / "one" / "checkpoint-2" / "optimizer.pt", weights_only=False)["state"]
    assert {i: {k: tuple(v.shape) for k, v in s.items()} for i, s in state.items()} == {
        i: {k: tuple(v.shape) for k, v in s.items()} for i, s in one.items()
    }


@pytest.mark.lf_subprocess
def test_fsdp2_keeps_one_expert_copy_per_machine(runs):
    """FSDP2 neither moves nor copies the experts: summed over the ranks, the shared mapping's
    PSS is one copy (within 5% + 8 KiB, as in test_distributed)."""
    root, _ = runs
    records = [json.loads(p.read_text()) for p in sorted((root / "memory").glob("rank*.json"))]
    assert len(records) == 2
    pss = sum(r["expert_mapping"]["Pss"] for r in records)
    assert abs(pss - records[0]["expert_bytes"]) <= 0.05 * records[0]["expert_bytes"] + 8192


# ----- the Trainer hook's own decisions (no training) -----


def _trainer(fsdp_enabled, version=2, fsdp=("full_shard",)):
    from types import SimpleNamespace

    model = torch.nn.Linear(2, 2)
    model._kt_ft_info = object()  # a kt-ft model
    plugin = SimpleNamespace(fsdp_version=version, ignored_modules=None)
    accelerator = SimpleNamespace(distributed_type="MULTI_CPU", state=SimpleNamespace(fsdp_plugin=plugin))
    return SimpleNamespace(
        model=model,
        is_fsdp_enabled=fsdp_enabled,
        accelerator=accelerator,
        args=SimpleNamespace(fsdp=list(fsdp)),
    )


def test_fsdp_dropped_by_accelerate_is_said(monkeypatch):
    """On a CPU-only machine accelerate drops the FSDP plugin (DDP trains): kt-ft says so."""
    from kt_ft.integrations.trainer import fsdp as fsdp_trainer

    said = []
    monkeypatch.setattr(fsdp_trainer.logger, "warning", said.append)
    trainer = _trainer(fsdp_enabled=False)
    fsdp_trainer.setup_fsdp2(trainer)
    assert said and "accelerate runs MULTI_CPU here" in said[0] and "kt-ft trains with DDP" in said[0]
    assert trainer.accelerator.state.fsdp_plugin.ignored_modules is None  # nothing touched
    said.clear()
    fsdp_trainer.setup_fsdp2(_trainer(fsdp_enabled=False, fsdp=()))  # FSDP not asked for: silent
    assert not said


def test_fsdp1_plugin_is_refused_at_trainer_start():
    """The parser refuses FSDP1 first; should accelerate still hold a version-1 plugin, the
    Trainer hook refuses it before anything is wrapped."""
    from kt_ft.integrations.trainer import fsdp as fsdp_trainer

    with pytest.raises(KTConfigError, match="fsdp_version=1 with use_kt: only FSDP2 is supported"):
        fsdp_trainer.setup_fsdp2(_trainer(fsdp_enabled=True, version=1))


def test_ignored_modules_keep_the_recipes_own():
    from kt_ft.integrations.trainer.fsdp import _ignored_modules

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert _ignored_modules("1", model) == [model[1]]  # accelerate's regex over module names
    assert _ignored_modules([model[0]], model) == [model[0]]
    assert _ignored_modules(None, model) == []


def test_deepspeed_on_the_command_line_is_refused():
    from kt_ft.integrations.trainer.parallel import check_raw_recipe

    with pytest.raises(KTConfigError, match="deepspeed='ds.json' with use_kt"):
        check_raw_recipe(["--model_name_or_path", "m", "--use_kt", "--deepspeed=ds.json"])
    check_raw_recipe(
        ["--use_kt", "false", "--deepspeed", "ds.json"]
    )  # not a kt-ft run: LLaMA-Factory's business
    check_raw_recipe(["--use_kt", "--fsdp", "full_shard"])  # FSDP: decided once parsed
