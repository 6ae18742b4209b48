"""Vision-language models for the e2e bench (``--preset qwen3-vl-30b-a3b``, ``tiny-vl``): a random
Qwen3-VL-MoE of a real config at a chosen depth, its processor, and examples that each pair a
picture with a text longer than ``cutoff_len`` tokens, in LLaMA-Factory's sharegpt format.

The language model of Qwen3-VL-30B-A3B is Qwen3-30B-A3B's (hidden 2048, 48 layers, 128 experts of
768, top-8, 32 query / 4 key-value heads of 128, vocabulary 151,936); its vision tower has 27
blocks of width 1152 (MLP 4304, 16 heads, patch 16, 2x2 merge, 2-frame temporal patch) feeding
the language model at blocks 8, 16 and 24 (deepstack). ``tiny-vl`` is the VL demo's tiny shapes
(``kt_ft/integrations/demo/vision.py``), for the CPU smoke test. The tokenizer is trained here (a vocabulary of
2,048 at most, as the text presets), with the vision tokens.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from kt_ft.integrations.bench.models import MODEL_CONFIGS
from kt_ft.integrations.demo.text import template_stop_words, train_tokenizer
from kt_ft.integrations.demo.vision import (
    _TEXT,
    _VISION,
    VISION_TOKEN_KEYS,
    VISION_TOKENS,
    dataset_info,
    draw_shape,
    make_processor,
)

TEMPLATE = "qwen3_vl_nothink"

# (text config, vision config, picture side in pixels): the real layer counts; --layers cuts the text
VL_PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "tiny-vl": (
        dict(
            _TEXT,
            vocab_size=1024,
            intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters=dict(
                rope_type="default", rope_theta=5_000_000.0, mrope_section=[4, 2, 2], mrope_interleaved=True
            ),
        ),
        dict(_VISION, deepstack_visual_indexes=[0]),
        64,
    ),
    "qwen3-vl-30b-a3b": (
        dict(
            # the language model is Qwen3-30B-A3B's (its router renormalises the top-k weights)
            {k: v for k, v in MODEL_CONFIGS["qwen3-30b-a3b"][1].items() if k != "norm_topk_prob"},
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=262144,
            hidden_act="silu",
            rope_parameters=dict(
                rope_type="default",
                rope_theta=5_000_000.0,
                mrope_section=[24, 20, 20],
                mrope_interleaved=True,
            ),
        ),
        dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=2048,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[8, 16, 24],
        ),
        448,  # 28 x 28 patches of 16, merged 2x2: 196 language tokens a picture
    ),
}


def is_vl(preset: str) -> bool:
    return preset in VL_PRESETS


def real_layers(preset: str) -> int:
    return VL_PRESETS[preset][0]["num_hidden_layers"]


def write_vl_assets(
    workdir: Path,
    preset: str,
    layers: int,
    cutoff_len: int,
    examples: int,
    texts: list[str],
    dataset: str,
    seed: int,
) -> tuple[Path, Path]:
    """``workdir/model`` (random bf16 weights of ``preset`` at ``layers`` language layers, the vision
    tower whole, tokenizer with the vision tokens, processor) and ``workdir/data`` (``examples``
    pictures, each with a user turn of the picture and a short question and an assistant turn of
    one of ``texts``). Returns (model dir, data dir)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    text_cfg, vision_cfg, side = VL_PRESETS[preset]
    model_dir, data_dir = workdir / "model", workdir / "data"
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    (data_dir / "images").mkdir(parents=True)
    rnd = random.Random(seed)
    rows = []
    for i in range(examples):
        path = f"images/{i:04d}.png"
        draw_shape(rnd.choice(["red", "green", "blue", "yellow"]), rnd.choice(["circle", "square", "triangle"]),
                   rnd, side=side).save(data_dir / path)  # fmt: skip
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": "<image>Describe the picture, then continue the text."},
                    {"role": "assistant", "content": texts[i % len(texts)]},
                ],
                "images": [path],
            }
        )
    (data_dir / f"{dataset}.json").write_text(json.dumps(rows))
    (data_dir / "dataset_info.json").write_text(json.dumps(dataset_info(dataset)))
    special = VISION_TOKENS + template_stop_words(TEMPLATE)
    vocab = min(2048, text_cfg["vocab_size"])
    tokenizer = train_tokenizer(
        texts[:64] + ["user assistant system"], vocab_size=vocab, extra_special=special
    )
    shortest = min(len(tokenizer(t)["input_ids"]) for t in texts)
    if shortest <= cutoff_len:
        raise RuntimeError(f"generated texts are too short: {shortest} tokens <= cutoff_len {cutoff_len}")
    tokenizer.model_max_length = max(cutoff_len * 2, 4096)
    tokens = dict(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, num_hidden_layers=layers,
    )  # fmt: skip
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in zip(VISION_TOKEN_KEYS, VISION_TOKENS)}
    config = AutoConfig.for_model(
        "qwen3_vl_moe", text_config={**text_cfg, **tokens}, vision_config=dict(vision_cfg),
        tie_word_embeddings=False, **ids,
    )  # fmt: skip
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    # random init on the GPU where there is one (minutes on the CPU for full-size layers)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    processor = make_processor(tokenizer)
    processor.image_processor.size = {"shortest_edge": 32 * 32, "longest_edge": side * side}
    processor.save_pretrained(model_dir)
    print(f"wrote {preset} x{layers} language layers to {model_dir} in {time.perf_counter() - t0:.0f} s")
    return model_dir, data_dir
