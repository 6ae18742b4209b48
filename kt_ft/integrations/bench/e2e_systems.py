"""`kt-ft bench --parts e2e`: the systems it compares and the `llamafactory-cli train` recipe of each.

``parse_systems`` reads ``--e2e-systems`` (``peft``, ``kt-cpu:<backend>``, ``kt-auto[@<GiB>]``,
``kt-stream``, ``kt-peer``, with ``+<format>`` and ``%<SETTING>=<value>`` suffixes: ``e2e.py``'s
doc); ``write_recipe`` writes one run's recipe (the common one plus the system's kt-ft keys) and
``write_rule`` the optimize rule a placement system names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from kt_ft.base import settings
from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.bench.e2e_assets import DATASET
from kt_ft.integrations.bench.vl_assets import TEMPLATE as VL_TEMPLATE
from kt_ft.integrations.bench.vl_assets import is_vl
from kt_ft.plan.family import family_of

LORA_RANK, LORA_ALPHA = 8, 16
QUANT_FORMATS = ("fp8", "int8", "int4")  # `kt-ft quantize` formats a `+<format>` system takes
DEFAULT_SYSTEMS = "peft,kt-auto,kt-auto@24,kt-auto@12,kt-stream,kt-cpu:kt-kernel,kt-cpu:torch"


@dataclass(frozen=True)
class System:
    """One `llamafactory-cli train` configuration: ``kind`` peft | cpu | auto | stream | peer."""

    name: str
    kind: str
    backend: str = "auto"
    cap_gib: float | None = None
    quant: str | None = None  # ``+fp8`` etc.: runs on the model's ``kt-ft quantize`` copy
    settings: tuple[tuple[str, str], ...] = ()  # ``%NAME=value`` (one or more): kt-ft settings for this run

    @property
    def use_kt(self) -> bool:
        """kt-ft's keys in the recipe (the peer has LLaMA-Factory's own use_kt keys instead)."""
        return self.kind not in ("peft", "peer")


def parse_systems(text: str) -> list[System]:
    """``peft,kt-cpu:torch,kt-auto,kt-auto@24,kt-stream`` -> systems; an unknown name is an error
    that lists the valid forms."""
    out = []
    for full in (s.strip() for s in text.split(",")):
        if not full:
            continue
        head, *suffixes = full.split("%")
        pairs = []
        for setting in suffixes:
            name, eq, value = setting.partition("=")
            if not eq or name not in settings.SETTINGS or not head.startswith("kt-") or head == "kt-peer":
                raise ValueError(
                    f"--systems: {full!r}: a '%<SETTING>=<value>' suffix takes one of kt-ft's settings "
                    f"({', '.join(settings.SETTINGS)}) after a kt-ft system"
                )
            if name == "KT_FT_FUSIONS":  # a bad name stops here, not in the run
                try:
                    settings.parse_fusions(value)
                except KTConfigError as e:
                    raise ValueError(f"--systems: {full!r}: {e.problems[0]}") from None
            pairs.append((name, value))
        raw, _, quant = head.partition("+")
        if quant:
            if quant not in QUANT_FORMATS or not raw.startswith("kt-") or raw == "kt-peer":
                raise ValueError(
                    f"--systems: {full!r}: a '+<format>' suffix takes one of {', '.join(QUANT_FORMATS)} "
                    "after a kt-ft system (kt-cpu:<backend>, kt-auto, kt-auto@<GiB>, kt-stream)"
                )
        n = len(out)
        if raw == "peft":
            out.append(System(raw, "peft"))
        elif raw.startswith("kt-cpu:") and raw.split(":", 1)[1]:
            out.append(System(raw, "cpu", backend=raw.split(":", 1)[1]))
        elif raw == "kt-auto":
            out.append(System(raw, "auto"))
        elif re.fullmatch(r"kt-auto@\d+(\.\d+)?", raw):
            out.append(System(raw, "auto", cap_gib=float(raw.split("@")[1])))
        elif raw == "kt-stream":
            out.append(System(raw, "stream"))
        elif raw == "kt-peer":
            out.append(System(raw, "peer"))
        else:
            raise ValueError(
                f"--systems: {raw!r} is not a system; valid: peft, kt-cpu:<backend> (torch, kt-kernel, ...), "
                "kt-auto, kt-auto@<GiB>, kt-stream, kt-peer; a kt-ft system may end in "
                f"+<format> ({', '.join(QUANT_FORMATS)})"
            )
        if quant and len(out) > n:
            out[-1] = replace(out[-1], name=full, quant=quant)
        if pairs and len(out) > n:
            out[-1] = replace(out[-1], name=full, settings=tuple(pairs))
    if not out:
        raise ValueError("--systems: no system named")
    return out


def write_rule(run_dir: Path, model_dir: Path, system: System) -> Path | None:
    """The optimize rule of ``system`` (None: the family's built-in rule, all experts on the CPU)
    for the model written to ``model_dir`` (its family from its config: hand-written or derived)."""
    if system.kind not in ("auto", "stream"):
        return None
    from transformers import AutoConfig

    family = family_of(AutoConfig.from_pretrained(model_dir))
    place = {"placement": "auto"} if system.kind == "auto" else {"stream": "all"}
    rule = [
        {"include": family.builtin_rule},
        {"match": {"class": family.experts_class}, "replace": {"device": "cpu", "backend": "auto", **place}},
    ]
    path = run_dir / "rule.yaml"
    path.write_text(yaml.safe_dump(rule, sort_keys=False))
    return path


def _has_cuda() -> bool:
    import torch  # why: only where a recipe is written

    return torch.cuda.is_available()


def write_recipe(
    run_dir: Path,
    system: System,
    *,
    model_dir: Path,
    data_dir: Path,
    preset: str,
    cutoff_len: int,
    steps: int,
    grad_accum: int,
    threads: int,
    bf16: bool,
    cpu_infer: int | None = None,
) -> Path:
    """``run_dir/recipe.yaml``: the common recipe plus ``system``'s kt-ft keys."""
    recipe = {
        "model_name_or_path": str(model_dir),
        "trust_remote_code": False,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_target": "all",
        "dataset_dir": str(data_dir),
        "dataset": DATASET,
        "template": VL_TEMPLATE if is_vl(preset) else "qwen",
        "cutoff_len": cutoff_len,
        "overwrite_cache": True,
        "preprocessing_num_workers": max(1, min(8, threads)),
        "dataloader_num_workers": 0,
        "output_dir": str(run_dir / "output"),
        "logging_steps": 1,
        "save_steps": 10 * steps + 10,  # no checkpoint inside the timed steps (the final save comes after)
        "overwrite_output_dir": True,
        "plot_loss": False,
        "report_to": "none",
        "include_num_input_tokens_seen": True,  # LF's trainer_log.jsonl then has total_tokens / throughput
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": grad_accum,
        "learning_rate": 1.0e-4,
        "max_steps": steps,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "seed": 42,
        "bf16": bf16,
    }
    if bf16 and not _has_cuda():  # HF refuses bf16 without a GPU unless told the run is on the CPU
        recipe["use_cpu"] = True
    if system.kind == "peer":
        # LLaMA-Factory 0.9.5's own keys: transformers-kt's TrainingArguments takes ``kt_config``
        # (kt_kernel.sft.config.KTConfig fields); LF itself passes lora_rank / alpha and cutoff_len.
        # kt-kernel's default activation policy recomputes the GPU part under non-reentrant
        # checkpointing only (with LF's default, reentrant, it stops: "activation_policy.gpu=recompute
        # requires non-reentrant gradient checkpointing with the KT context_fn")
        recipe.update(
            use_kt=True,
            kt_config={"kt_backend": "AMXBF16", "kt_num_threads": cpu_infer or threads},
            use_reentrant_gc=False,
        )
    if system.use_kt:
        recipe.update(use_kt=True, chunk_size=cutoff_len, kt_backend=system.backend)
        if cpu_infer is not None:  # else kt-ft's default, as a recipe without the key gets
            recipe["cpu_infer"] = cpu_infer
        rule = write_rule(run_dir, model_dir, system)
        if rule is not None:
            recipe["kt_optimize_rule"] = str(rule)
        if system.cap_gib is not None:
            recipe["kt_gpu_memory"] = system.cap_gib
    path = run_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path
