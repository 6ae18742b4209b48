"""Which data-parallel engine an HF Trainer run of a kt-ft model asks for, and the ones kt-ft
refuses, before any weight is read (LLaMA-Factory's parser calls both checks).

LLaMA-Factory 0.9.5 trains through the HF Trainer, whose accelerate ``Accelerator`` picks the
engine from two places:

* the recipe: ``fsdp: full_shard auto_wrap`` plus ``fsdp_config: {fsdp_version: 2, ...}`` (HF
  ``TrainingArguments``; ``fsdp_version`` defaults to 1), or ``deepspeed: ds_config.json``;
* ``accelerate launch --config_file cfg.yaml`` with ``distributed_type: FSDP`` (exported as
  ``ACCELERATE_USE_FSDP=true`` and ``FSDP_VERSION``) or ``DEEPSPEED``
  (``ACCELERATE_USE_DEEPSPEED=true``).

kt-ft supports DDP (the default with several processes) and FSDP2: ``fully_shard`` with every
``KTExperts`` parameter ignored (``kt_ft.integrations.trainer.fsdp``). It refuses, naming the
setting: DeepSpeed (its engine owns the parameters, gradients and optimizer of the whole
model: it would partition or broadcast the CPU experts and cannot leave their LoRA to kt-ft),
FSDP1 (its FlatParameter wrapping is not supported; FSDP2 is), and FSDP2's
``cpu_ram_efficient_loading`` (accelerate would move the model to ``meta`` and re-broadcast
every weight from rank 0, experts included; kt-ft already loads the experts once per machine).
"""

from __future__ import annotations

import os
from typing import Any

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.recipe import recipe_source

DDP = "ddp"
FSDP2 = "fsdp2"

_SUPPORTED = "supported with use_kt: DDP (the default with several processes) and FSDP2"


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _env_flag(name: str) -> bool:
    return _truthy(os.environ.get(name, "false"))


def _cli_keys(argv: list[str]) -> dict[str, str]:
    """``--key value`` / ``--key=value`` / bare ``--flag`` command-line arguments as a dict."""
    keys: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = str(argv[i])
        if token.startswith("--"):
            key, eq, value = token[2:].partition("=")
            if not eq:
                has_value = i + 1 < len(argv) and not str(argv[i + 1]).startswith("--")
                value = str(argv[i + 1]) if has_value else "true"
                i += has_value
            keys[key] = value
        i += 1
    return keys


def check_raw_recipe(args: Any) -> None:
    """On the recipe's raw keys (a recipe file's dict, or command-line arguments), before HF
    parses them (with ``deepspeed`` set, HF's ``TrainingArguments`` imports and configures
    DeepSpeed first): refuse DeepSpeed with kt-ft."""
    if isinstance(args, (list, tuple)):
        args = _cli_keys(list(args))
    if not isinstance(args, dict) or not _truthy(args.get("use_kt", False)):
        return
    if args.get("deepspeed"):
        raise KTConfigError(_deepspeed_problem(f"{recipe_source()}: deepspeed={args['deepspeed']!r}"))
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise KTConfigError(_deepspeed_problem(_accelerate_setting("distributed_type: DEEPSPEED")))


def _deepspeed_problem(setting: str) -> str:
    return (
        f"{setting} with use_kt: DeepSpeed is not supported ({_SUPPORTED}); DeepSpeed's engine owns every "
        "parameter, gradient and optimizer state of the model, so it would partition or broadcast kt-ft's CPU "
        "experts and reduce their LoRA itself. Remove it; for sharding use FSDP2 (README: Several GPUs / processes)"
    )


def _accelerate_setting(what: str) -> str:
    return f"accelerate config ({what}, from `accelerate launch --config_file`)"


def requested_engine(training_args: Any) -> tuple[str, str | None]:
    """(engine, where it was set) for a parsed recipe: ``(DDP, None)`` unless FSDP is asked for;
    FSDP version 1 and DeepSpeed raise (see the module docstring)."""
    src = recipe_source()
    if getattr(training_args, "deepspeed", None):
        raise KTConfigError(_deepspeed_problem(f"{src}: deepspeed={training_args.deepspeed!r}"))
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise KTConfigError(_deepspeed_problem(_accelerate_setting("distributed_type: DEEPSPEED")))
    fsdp = list(getattr(training_args, "fsdp", None) or [])
    config = getattr(training_args, "fsdp_config", None) or {}
    if fsdp:
        version = config.get("version", 1)
        where = (
            f"{src}: fsdp={' '.join(str(getattr(o, 'value', o)) for o in fsdp)!r} with "
            f"fsdp_config.fsdp_version={version!r}" + ("" if "version" in config else " (HF's default)")
        )
        efficient = config.get("cpu_ram_efficient_loading", False)
        efficient_where = f"{src}: fsdp_config.cpu_ram_efficient_loading={efficient!r}"
    elif _env_flag("ACCELERATE_USE_FSDP"):
        version = os.environ.get("FSDP_VERSION", "1")
        where = _accelerate_setting(f"distributed_type: FSDP, fsdp_version: {version}")
        efficient = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
        efficient_where = _accelerate_setting(f"fsdp_cpu_ram_efficient_loading: {efficient}")
    else:
        return DDP, None
    if str(version) != "2":
        raise KTConfigError(
            f"{where} with use_kt: FSDP version {version} is not supported ({_SUPPORTED}); kt-ft keeps its CPU "
            "experts out of FSDP with fully_shard's ignored_params, which FSDP1's FlatParameter wrapping does not "
            "have. Set fsdp_version: 2 (recipe: fsdp_config.fsdp_version; accelerate config: fsdp_version), or "
            "drop FSDP to train with DDP"
        )
    if _truthy(efficient):
        raise KTConfigError(
            f"{efficient_where} with use_kt: not supported; accelerate would move the model to meta and "
            "broadcast every weight from rank 0, routed experts included, while kt-ft already loads them once "
            "per machine (shared by its ranks). Remove cpu_ram_efficient_loading"
        )
    return FSDP2, where
