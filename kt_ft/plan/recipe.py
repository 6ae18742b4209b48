"""What a kt-ft run is asked for, defined once: ``KTConfig`` (what ``kt_ft.apply`` takes) and the
recipe keys LLaMA-Factory parses (``KTArguments``), made from ``KTConfig``'s fields that carry a
recipe key, with the same defaults, help text and validation.

LLaMA-Factory parses ``KTArguments`` as part of its ``ModelArguments`` (see
``kt_ft.integrations.llamafactory.patches``), so ``llamafactory-cli train -h`` lists these keys
with their help text. This module imports neither torch nor llamafactory.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

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


def _key(recipe: str, default: Any, help: str) -> Any:
    """A ``KTConfig`` field that is also the recipe key ``recipe`` (same default, ``help`` shown by
    ``llamafactory-cli train -h`` and LlamaBoard)."""
    return field(default=default, metadata={"recipe": recipe, "help": help})


@dataclass
class KTConfig:
    """What ``kt_ft.apply`` does to a model. Fields with a recipe key (``recipe_key``) are
    LLaMA-Factory recipe keys too (``KTArguments``); the others come from LLaMA-Factory's own keys
    or the run: rank, alpha, use_rslora [lora_rank, lora_alpha, use_rslora]; cutoff_len, batch
    [cutoff_len, per_device_train_batch_size], for ``placement: auto``.

    seed: expert-LoRA init (None: torch's global generator). lora_dtype: the expert LoRA's
    parameters' torch dtype (None: float32; bfloat16 under [pure_bf16], which keeps every trainable
    parameter bf16, its grads and AdamW moments with it). adapter: an adapter directory whose
    expert LoRA is loaded (manifest, sizes and sha256 checked); base_model: the model's path or
    name, recorded in the adapter's manifest; experts_trainable False: the expert LoRA stays frozen
    (a vision-language recipe that freezes the language model)."""

    rule: str | None = _key(
        "kt_optimize_rule",
        None,
        "kt-ft placement rule: a YAML file path or a built-in rule name (see `kt-ft rules list`). "
        "Default: the built-in rule of the model's family.",
    )
    rank: int = 8
    alpha: float = 16
    use_rslora: bool = False
    backend: str = _key(
        "kt_backend",
        "auto",
        "kt-ft CPU expert backend: auto (the fastest this CPU runs), torch (portable, grouped), "
        "torch-ep (torch with experts in parallel threads), native (kt-ft's own C++ kernels: AVX2, AVX-512, "
        "AMX), reference (slow pure-torch loop, for checking) or kt-kernel (AMX/AVX512-BF16 CPUs).",
    )
    threads: int | None = _key(
        "cpu_infer",
        None,
        "kt-ft: CPU threads for the routed-expert operator. Default: physical cores minus a few.",
    )
    chunk_size: int = _key(
        "chunk_size",
        4096,
        "kt-ft: at most this many tokens per CPU expert call; longer batches are split into chunks.",
    )
    gpu_memory_gib: float | None = _key(
        "kt_gpu_memory",
        None,
        "kt-ft placement: auto: GiB of the training GPU the run may use (routed experts resident or "
        "streamed there share it with everything else). Default: the GPU's free memory at start.",
    )
    cutoff_len: int = 2048
    batch: int = 1
    replan_steps: int = _key(
        "kt_replan_steps",
        0,
        "kt-ft placement: auto: every this many optimizer steps, compare each layer's routing counts "
        "with those of the last plan and re-plan the GPU-resident experts when they drifted (0: never; the "
        "one check of the CPU op's rate after 3 steps happens either way).",
    )
    replan_threshold: float = _key(
        "kt_replan_threshold",
        0.1,
        "kt-ft placement: auto: re-plan when a layer's routing distribution moved by more than this "
        "total variation distance (0-1) since the last plan.",
    )
    remeasure: bool = _key(
        "kt_remeasure",
        False,
        "kt-ft placement: auto: measure this machine's CPU / link / GPU rates again instead of using "
        "~/.cache/kt-ft/rates.json.",
    )
    seed: int | None = None
    lora_dtype: Any = None
    adapter: str | None = None
    base_model: str | None = None
    experts_trainable: bool = True

    @property
    def scaling(self) -> float:
        """The expert LoRA's scale, as PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        from kt_ft.formats.lora_layout import lora_scaling  # why: this module stays torch-free (doc)

        return lora_scaling(rank=self.rank, alpha=self.alpha, use_rslora=self.use_rslora)

    def problems(self, source: str = "KTConfig", *, recipe: bool = False) -> list[str]:
        """Every invalid value, each naming ``source`` and the key (the recipe key with ``recipe``,
        else the field), the value and what is valid. Loads the rule file (syntax and values;
        matching waits for the model)."""

        def name(attr: str) -> str:
            return RECIPE_KEYS[attr] if recipe else attr

        out: list[str] = []
        threads = self.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            out.append(
                f"{source}: {name('threads')}={threads!r} is invalid: expected a positive integer number of CPU "
                f"threads (this machine has {physical_cpu_cores()} physical cores)"
            )
        chunk = self.chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            out.append(
                f"{source}: {name('chunk_size')}={chunk!r} is invalid: expected a positive integer (max tokens per "
                "CPU expert call, e.g. 4096)"
            )
        if self.backend not in KT_BACKENDS:
            out.append(
                f"{source}: {name('backend')}={self.backend!r} is invalid: valid choices are {', '.join(KT_BACKENDS)}"
            )
        if self.rule is not None:
            rule_path = resolve_rule_path(str(self.rule))
            if rule_path is None:
                out.append(
                    f"{source}: {name('rule')}={self.rule!r}: no such file and no built-in rule of that "
                    f"name; built-in rules: {', '.join(builtin_rule_names()) or '(none)'}"
                )
            else:
                try:
                    load_rules(rule_path)  # syntax and values now; matching once the model exists
                except KTConfigError as e:
                    out.extend(e.problems)
        gpu = self.gpu_memory_gib
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, int | float) or not gpu > 0):
            out.append(
                f"{source}: {name('gpu_memory_gib')}={gpu!r} is invalid: expected a positive number of GiB "
                "(or leave it out: the GPU's free memory at start)"
            )
        steps = self.replan_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            out.append(
                f"{source}: {name('replan_steps')}={steps!r} is invalid: expected a non-negative integer "
                "(0: never re-plan)"
            )
        tvd = self.replan_threshold
        if isinstance(tvd, bool) or not isinstance(tvd, int | float) or not 0 < tvd <= 1:
            out.append(
                f"{source}: {name('replan_threshold')}={tvd!r} is invalid: expected a total variation distance "
                "in (0, 1]"
            )
        return out

    def validate(self, source: str = "KTConfig") -> KTConfig:
        """Raise one KTConfigError listing every problem (``problems``); return self."""
        if problems := self.problems(source):
            raise KTConfigError(problems)
        return self


# KTConfig field -> its recipe key, for the fields that are recipe keys
RECIPE_KEYS: dict[str, str] = {
    f.name: f.metadata["recipe"] for f in fields(KTConfig) if "recipe" in f.metadata
}


def _post_init(self) -> None:
    parent = super(KTArguments, self)
    if hasattr(parent, "__post_init__"):
        parent.__post_init__()
    if self.use_kt:
        self.validate_kt()


def _validate_kt(self, *, source: str | None = None) -> None:
    """Check every kt-ft key at once; raise one KTConfigError listing all problems, each naming
    ``source`` (default: the recipe file on the command line; LlamaBoard passes the file it writes).
    An unset ``cpu_infer`` becomes this machine's default here."""
    src = source or recipe_source()
    if self.cpu_infer is None:
        self.cpu_infer = default_cpu_infer()
    problems = self.kt_config().problems(src, recipe=True)
    for key in FORK_ONLY_KEYS:
        if getattr(self, key, None) is not None:
            problems.append(
                f"{src}: {key}={getattr(self, key)!r} belongs to LLaMA-Factory's KTransformers-fork path, which "
                "kt-ft replaces; remove it (kt-ft reads the experts from model_name_or_path)"
            )
    if problems:
        raise KTConfigError(problems)


def _kt_config(self, **run: Any) -> KTConfig:
    """The ``KTConfig`` these recipe keys say, with ``run``'s fields (rank, cutoff_len, ...; a
    field given there wins, e.g. the threads of this rank out of ``cpu_infer``)."""
    return KTConfig(**{**{attr: getattr(self, key) for attr, key in RECIPE_KEYS.items()}, **run})


def _apply_kt_config(
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


KTArguments = make_dataclass(
    "KTArguments",
    [
        (
            "use_kt",
            "bool",
            field(
                default=False,
                metadata={
                    "help": "Fine-tune with kt-ft: routed MoE experts stay in CPU RAM and are computed (with their "
                    "LoRA) by a CPU operator; everything else trains on the GPU with PEFT LoRA."
                },
            ),
        ),
        *(
            (f.metadata["recipe"], f.type, field(default=f.default, metadata={"help": f.metadata["help"]}))
            for f in fields(KTConfig)
            if "recipe" in f.metadata
        ),
    ],
    namespace={
        "__doc__": "kt-ft's keys in a LLaMA-Factory recipe: ``use_kt`` and ``KTConfig``'s recipe keys.",
        "__module__": __name__,
        "__post_init__": _post_init,
        "validate_kt": _validate_kt,
        "kt_config": _kt_config,
        "apply_kt_config": _apply_kt_config,
    },
)
