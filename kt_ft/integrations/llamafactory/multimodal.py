"""Vision-language recipes: LLaMA-Factory's scope flags as kt-ft reads them, bad input refused early.

LLaMA-Factory 0.9.5 sets the LoRA scope of a vision-language ("composite") model with three flags
(``llamafactory/model/model_utils/visual.py``): ``freeze_vision_tower`` (default true: no LoRA in
the vision blocks), ``freeze_multi_modal_projector`` (default true: none in the merger) and
``freeze_language_model`` (default false). With LoRA they only choose where PEFT puts its
adapters; kt-ft's expert LoRA sits in the language model's routed experts, so it is trained exactly
when the language model is (``expert_lora_trainable``).

Refused before any weight is read (``check_multimodal_recipe``, with every problem named):

* a dataset whose ``dataset_info.json`` entry has an ``images`` or ``videos`` column on a model whose
  config has no vision tower (LLaMA-Factory itself would say only that the template does not take
  images, or train on the text and drop the pictures);
* a scope that leaves nothing to train: vision tower and language model both frozen, and the
  projector frozen too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kt_ft.base.errors import KTConfigError
from kt_ft.base.log import get_logger
from kt_ft.plan.recipe import recipe_source

logger = get_logger(__name__)

MEDIA_COLUMNS = ("images", "videos")


def composite_model(model_type: str | None):
    """LLaMA-Factory's ``CompositeModel`` entry for ``model_type`` (its vision / projector /
    language-model key lists), or None for a text-only model type."""
    from llamafactory.model.model_utils.visual import COMPOSITE_MODELS

    return COMPOSITE_MODELS.get(model_type)


def expert_lora_trainable(config: Any, finetuning_args: Any) -> bool:
    """False when the recipe freezes the language model of a composite model (the routed experts
    are part of it); True otherwise."""
    frozen = bool(getattr(finetuning_args, "freeze_language_model", False))
    return not (frozen and composite_model(getattr(config, "model_type", None)) is not None)


def media_columns(dataset_dir: str | None, names: list[str] | None) -> dict[str, list[str]]:
    """Dataset name -> its media columns (``images``, ``videos``) per ``dataset_dir/dataset_info.json``;
    names the file does not describe (hub datasets, no file) are left out."""
    info_path = Path(dataset_dir or "") / "dataset_info.json"
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return {}
    found = {}
    for name in names or []:
        columns = (info.get(name) or {}).get("columns") or {}
        media = [c for c in MEDIA_COLUMNS if c in columns]
        if media:
            found[name] = media
    return found


def _load_config(model_args: Any):
    """The model's config (no weight read), or None where it cannot be read here (LLaMA-Factory
    reports that itself, with its own message)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            model_args.model_name_or_path,
            trust_remote_code=bool(getattr(model_args, "trust_remote_code", False)),
        )
    except (OSError, ValueError):
        return None


def _scope_problems(model_type: str, finetuning_args: Any) -> list[str]:
    src = recipe_source()
    if getattr(finetuning_args, "finetuning_type", "lora") != "lora":
        return []
    vision = bool(getattr(finetuning_args, "freeze_vision_tower", True))
    language = bool(getattr(finetuning_args, "freeze_language_model", False))
    projector = bool(getattr(finetuning_args, "freeze_multi_modal_projector", True))
    if vision and language and projector:
        return [
            f"{src}: freeze_vision_tower=true, freeze_language_model=true and freeze_multi_modal_projector=true "
            f"freeze every part of this {model_type} model: LoRA would train nothing; set freeze_language_model: "
            "false (text, the default), or freeze_vision_tower: false (vision only, or both with the language model)"
        ]
    return []


def check_multimodal_recipe(model_args: Any, data_args: Any, finetuning_args: Any) -> None:
    """Refuse the bad inputs of the module doc, all at once (KTConfigError naming the recipe keys),
    before the tokenizer, dataset or model is loaded."""
    config = _load_config(model_args)
    if config is None:
        return
    model_type = getattr(config, "model_type", None)
    has_vision = getattr(config, "vision_config", None) is not None
    problems = []
    names = getattr(data_args, "dataset", None) or []
    eval_names = getattr(data_args, "eval_dataset", None) or []
    media = media_columns(getattr(data_args, "dataset_dir", None), [*names, *eval_names])
    if media and not has_vision:
        listed = ", ".join(f"{n} ({', '.join(c)})" for n, c in media.items())
        problems.append(
            f"{recipe_source()}: dataset={','.join([*names, *eval_names])} has media columns [{listed}] in "
            f"{Path(data_args.dataset_dir) / 'dataset_info.json'}, but model_name_or_path="
            f"{model_args.model_name_or_path} is a text-only {model_type} model (no vision_config); use a "
            "vision-language model (e.g. qwen3_vl_moe, qwen3_5_moe) or a dataset without images"
        )
    if composite_model(model_type) is not None:
        problems += _scope_problems(model_type, finetuning_args)
    if problems:
        raise KTConfigError(problems)
