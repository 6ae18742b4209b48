"""LLaMA-Factory 0.9.5's chat engine (``llamafactory.chat.hf_engine``) with a kt-ft model: pictures
given to a model that cannot read them are refused with the model and the fix named.

``llamafactory-cli chat`` / ``api`` / ``webchat`` and ``ChatModel`` all build a generation's inputs
in ``HuggingfaceEngine._process_args``, where the images, videos and audios of a request meet the
template's multimodal plugin. For a text-only model LLaMA-Factory's own message ("This model does
not support image input. Please check whether the correct `template` is used.") points at the
template, which no template can fix. Only models kt-ft is attached to (``_kt_ft_info``) are
checked; every other model goes to the original unchanged.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kt_ft.base.errors import KTConfigError

# media kind -> the config key of the tower that reads it
MEDIA_TOWERS = {"images": "vision_config", "videos": "vision_config", "audios": "audio_config"}
# media kind -> the attribute of LLaMA-Factory's mm plugin naming its placeholder token
PLUGIN_TOKENS = {"images": "image_token", "videos": "video_token", "audios": "audio_token"}


def _model_template(config: Any) -> str | None:
    """The LLaMA-Factory template of the family's real checkpoints, or None where kt-ft has none."""
    from kt_ft.plan.family import family_of  # why: the families import transformers' configs, on use only

    try:
        return family_of(config).template or None
    except (KTConfigError, ValueError):
        return None


def media_problem(model: Any, template: Any, media: dict[str, list | None]) -> str | None:
    """Why the chat cannot take ``media`` (kind -> list) with ``model`` and LLaMA-Factory's
    ``template``, or None when it can (or nothing is given)."""
    given = [kind for kind, items in media.items() if items]
    if not given:
        return None
    config = model.config
    path = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", "?")
    model_type = getattr(config, "model_type", "?")
    unread = [kind for kind in given if getattr(config, MEDIA_TOWERS[kind], None) is None]
    if unread:
        towers = sorted({MEDIA_TOWERS[kind] for kind in unread})
        return (
            f"{' and '.join(unread)} given to the chat (ChatModel.chat({unread[0]}=...), an api message's "
            f"{unread[0][:-1]}_url part, a webchat upload), but model_name_or_path={path} is a {model_type} "
            f"model with no {' / '.join(towers)}: it reads text only; chat without them, or use a "
            "vision-language model (e.g. qwen3_vl_moe, qwen3_5_moe) with its template"
        )
    plugin = template.mm_plugin
    untaken = [kind for kind in given if getattr(plugin, PLUGIN_TOKENS[kind], None) is None]
    if untaken:
        want = _model_template(config)
        fix = f"template: {want} or another of its templates" if want else "the model's multimodal template"
        return (
            f"{' and '.join(untaken)} given to the chat, but its template (mm plugin "
            f"{type(plugin).__name__}) takes none: the {model_type} model at model_name_or_path={path} "
            f"reads them through its own template; set {fix} (docs/multimodal.md)"
        )
    return None


def patch_hf_engine_module(hf_engine: ModuleType) -> None:
    """Wrap ``HuggingfaceEngine._process_args`` (a staticmethod, called on the class by ``_chat``,
    ``_stream_chat`` and ``_get_scores``) with :func:`media_problem` for kt-ft's models."""
    engine = hf_engine.HuggingfaceEngine
    if getattr(engine, "_kt_ft_patched", False):
        return
    original = engine._process_args

    def _process_args(model, tokenizer, processor, template, generating_args, messages, *args, **kwargs):
        if getattr(model, "_kt_ft_info", None) is not None:
            names = ("system", "tools", "images", "videos", "audios")
            bound = {**dict(zip(names, args)), **kwargs}
            media = {kind: bound.get(kind) for kind in MEDIA_TOWERS}
            problem = media_problem(model, template, media)
            if problem is not None:
                raise KTConfigError(problem)
        return original(model, tokenizer, processor, template, generating_args, messages, *args, **kwargs)

    engine._process_args = staticmethod(_process_args)
    engine._kt_ft_patched = True
