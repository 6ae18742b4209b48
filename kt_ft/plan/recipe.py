"""The kt-ft recipe keys: one dataclass, validated on parse.

LLaMA-Factory parses it as part of its ``ModelArguments`` (see ``kt_ft.integrations.llamafactory.patches``),
so ``llamafactory-cli train -h`` lists these keys with their help text. This module imports
neither torch nor llamafactory.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.builtin import builtin_rule_names, resolve_rule_path
from kt_ft.plan.loader import load_rules
from kt_ft.plan.schema import KT_BACKENDS

# LLaMA-Factory 0.9.5's own `use_kt` keys drive the forked transformers-kt/accelerate-kt path,
# which kt-ft replaces; setting them together with kt-ft's `use_kt` would silently do nothing.
FORK_ONLY_KEYS = (
    "kt_weight_path",
    "kt_expert_checkpoint_path",
    "kt_use_lora_experts",
    "kt_lora_expert_num",
    "kt_lora_expert_intermediate_size",
)


def physical_cpu_cores() -> int:
    """Physical cores this process may run on (logical CPUs when the topology is unreadable)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (
                    topo.joinpath("physical_package_id").read_text().strip(),
                    topo.joinpath("core_id").read_text().strip(),
                )
            )
        except OSError:
            return len(allowed)
    return max(1, len(cores))


def default_cpu_infer() -> int:
    """Physical cores minus a few left for the data loader, the GPU driver thread and the OS."""
    cores = physical_cpu_cores()
    return cores - 2 if cores > 8 else max(1, cores - 1) if cores > 2 else cores


def recipe_source() -> str:
    """The recipe file named on the command line, for error messages (``<arguments>`` otherwise)."""
    for arg in sys.argv[1:3]:
        if arg.endswith((".yaml", ".yml", ".json")):
            return arg
    return "<arguments>"


@dataclass
class KTArguments:
    """kt-ft's keys in a LLaMA-Factory recipe."""

    use_kt: bool = field(
        default=False,
        metadata={
            "help": "Fine-tune with kt-ft: routed MoE experts stay in CPU RAM and are computed (with their "
            "LoRA) by a CPU operator; everything else trains on the GPU with PEFT LoRA."
        },
    )
    kt_optimize_rule: str | None = field(
        default=None,
        metadata={
            "help": "kt-ft placement rule: a YAML file path or a built-in rule name (see `kt-ft rules list`). "
            "Default: the built-in rule of the model's family."
        },
    )
    cpu_infer: int | None = field(
        default=None,
        metadata={
            "help": "kt-ft: CPU threads for the routed-expert operator. Default: physical cores minus a few."
        },
    )
    chunk_size: int = field(
        default=4096,
        metadata={
            "help": "kt-ft: at most this many tokens per CPU expert call; longer batches are split into chunks."
        },
    )
    kt_backend: str = field(
        default="auto",
        metadata={
            "help": "kt-ft CPU expert backend: auto (the fastest this CPU runs), torch (portable, grouped), "
            "torch-ep (torch with experts in parallel threads), native (kt-ft's own C++ kernels: AVX2, AVX-512, "
            "AMX), "
            "reference (slow pure-torch loop, for checking) or kt-kernel (AMX/AVX512-BF16 CPUs)."
        },
    )

    kt_gpu_memory: float | None = field(
        default=None,
        metadata={
            "help": "kt-ft placement: auto: GiB of the training GPU the run may use (routed experts resident or "
            "streamed there share it with everything else). Default: the GPU's free memory at start."
        },
    )
    kt_remeasure: bool = field(
        default=False,
        metadata={
            "help": "kt-ft placement: auto: measure this machine's CPU / link / GPU rates again instead of using "
            "~/.cache/kt-ft/rates.json."
        },
    )
    kt_replan_steps: int = field(
        default=0,
        metadata={
            "help": "kt-ft placement: auto: every this many optimizer steps, compare each layer's routing counts "
            "with those of the last plan and re-plan the GPU-resident experts when they drifted (0: never; the "
            "one check of the CPU op's rate after 3 steps happens either way)."
        },
    )
    kt_replan_threshold: float = field(
        default=0.1,
        metadata={
            "help": "kt-ft placement: auto: re-plan when a layer's routing distribution moved by more than this "
            "total variation distance (0-1) since the last plan."
        },
    )

    def __post_init__(self) -> None:
        parent = super()
        if hasattr(parent, "__post_init__"):
            parent.__post_init__()
        if self.use_kt:
            self.validate_kt()

    def validate_kt(self, *, source: str | None = None) -> None:
        """Check every kt-ft key at once; raise one KTConfigError listing all problems, each naming
        ``source`` (default: the recipe file on the command line; LlamaBoard passes the file it writes)."""
        src = source or recipe_source()
        problems: list[str] = []
        if self.cpu_infer is None:
            self.cpu_infer = default_cpu_infer()
        elif isinstance(self.cpu_infer, bool) or not isinstance(self.cpu_infer, int) or self.cpu_infer < 1:
            problems.append(
                f"{src}: cpu_infer={self.cpu_infer!r} is invalid: expected a positive integer number of CPU "
                f"threads (this machine has {physical_cpu_cores()} physical cores)"
            )
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            problems.append(
                f"{src}: chunk_size={self.chunk_size!r} is invalid: expected a positive integer (max tokens per "
                "CPU expert call, e.g. 4096)"
            )
        if self.kt_backend not in KT_BACKENDS:
            problems.append(
                f"{src}: kt_backend={self.kt_backend!r} is invalid: valid choices are {', '.join(KT_BACKENDS)}"
            )
        if self.kt_optimize_rule is not None:
            rule_path = resolve_rule_path(self.kt_optimize_rule)
            if rule_path is None:
                problems.append(
                    f"{src}: kt_optimize_rule={self.kt_optimize_rule!r}: no such file and no built-in rule of that "
                    f"name; built-in rules: {', '.join(builtin_rule_names()) or '(none)'}"
                )
            else:
                try:
                    load_rules(rule_path)  # syntax and values now; matching once the model exists
                except KTConfigError as e:
                    problems.extend(e.problems)
        if self.kt_gpu_memory is not None and (
            isinstance(self.kt_gpu_memory, bool)
            or not isinstance(self.kt_gpu_memory, int | float)
            or not self.kt_gpu_memory > 0
        ):
            problems.append(
                f"{src}: kt_gpu_memory={self.kt_gpu_memory!r} is invalid: expected a positive number of GiB "
                "(or leave it out: the GPU's free memory at start)"
            )
        steps = self.kt_replan_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            problems.append(
                f"{src}: kt_replan_steps={steps!r} is invalid: expected a non-negative integer (0: never re-plan)"
            )
        tvd = self.kt_replan_threshold
        if isinstance(tvd, bool) or not isinstance(tvd, int | float) or not 0 < tvd <= 1:
            problems.append(
                f"{src}: kt_replan_threshold={tvd!r} is invalid: expected a total variation distance in (0, 1]"
            )
        for key in FORK_ONLY_KEYS:
            if getattr(self, key, None) is not None:
                problems.append(
                    f"{src}: {key}={getattr(self, key)!r} belongs to LLaMA-Factory's KTransformers-fork path, which "
                    "kt-ft replaces; remove it (kt-ft reads the experts from model_name_or_path)"
                )
        if problems:
            raise KTConfigError(problems)

    def apply_kt_config(
        self, finetuning_args=None, training_args=None, model_max_length=None, *args, **kwargs
    ) -> None:
        """LLaMA-Factory calls this (for its fork path: env vars for accelerate-kt) once the training
        arguments exist; kt-ft only notes the tokens per micro-batch (cutoff_len x
        per_device_train_batch_size) for ``placement: auto``."""
        batch = getattr(training_args, "per_device_train_batch_size", None)
        if model_max_length and batch:
            self._kt_ft_micro_batch = (int(model_max_length), int(batch))
        rank = getattr(finetuning_args, "lora_rank", None)
        if rank:
            self._kt_ft_lora_rank = int(rank)  # the GPU-memory check before loading counts PEFT's LoRA
        # pure_bf16: LoRA parameters (PEFT's and the expert LoRA) stay bf16, half the training state
        self._kt_ft_pure_bf16 = bool(getattr(finetuning_args, "pure_bf16", False))
        return None
