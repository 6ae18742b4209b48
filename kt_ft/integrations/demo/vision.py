"""Tiny offline vision-language demo: a random Qwen3-VL-MoE (or Qwen3.5-MoE), its processor, images.

``make_demo_vl_model(DIR)`` writes, with nothing downloaded:

* ``DIR/model``: a random ``Qwen3VLMoeForConditionalGeneration`` (or
  ``Qwen3_5MoeForConditionalGeneration``) from a tiny config -- a 2-block vision tower (patch 16,
  2x2 merge: a 64x64 image is 4x4 patches, 4 language tokens), its merger (the multimodal
  projector) and a 2-layer MoE language model, 8 experts top-2, hidden 64, expert width 48 -- with a byte-level BPE
  tokenizer trained locally that has the vision tokens (``<|vision_start|>``, ``<|image_pad|>``,
  ...), and a ``Qwen3VLProcessor`` (image processor config: patch 16, merge 2, mean/std 0.5);
* ``DIR/data``: ``images/*.png`` (a coloured circle, square or triangle on white, drawn with PIL),
  ``kt_demo_vl.json`` (LLaMA-Factory sharegpt format: ``messages`` with an ``<image>`` placeholder,
  ``images`` a list of paths relative to the data dir) and its ``dataset_info.json``.

The answers depend only on the picture (its colour and shape), so the loss falls only when the
image reaches the language model.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kt_ft.base.errors import KTConfigError
from kt_ft.integrations.demo.text import SPECIAL_TOKENS, template_stop_words, train_tokenizer

DATASET_NAME = "kt_demo_vl"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# config keys of the vision token ids, in VISION_TOKENS order
VISION_TOKEN_KEYS = ["vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"]
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIDE = 64  # pixels: 4x4 patches of 16, merged 2x2 into 4 language tokens
QUESTIONS = (
    ("What is in the picture?", "A {color} {shape}."),
    ("What color is the shape?", "It is {color}."),
    ("Which shape is drawn?", "A {shape}."),
)

# Attention shapes shared with the text demo configs (4 heads of 16, 2 kv heads).
_TEXT = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    hidden_act="silu",
    num_hidden_layers=2,
    # 2I = 96 != H = 64: the fused gate_up_proj [E, 2I, H] and its transpose (the layout of the
    # hub's Qwen3-VL-MoE files) differ in shape, so a layout mix-up fails instead of passing
    moe_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
)
# A 2-block vision tower; out_hidden_size is the language model's hidden size. 64 position
# embeddings: an 8x8 grid, interpolated to each image's patch grid.
_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
)


@dataclass(frozen=True)
class VLDemo:
    """What differs between the vision-language families the demo builds."""

    model_type: str  # the composite config's model_type
    template: str  # LLaMA-Factory chat template of the instruct checkpoints
    text: dict[str, Any]
    vision: dict[str, Any]


VL_DEMOS: dict[str, VLDemo] = {
    "qwen3_vl_moe": VLDemo(
        model_type="qwen3_vl_moe",
        template="qwen3_vl_nothink",
        # multimodal RoPE: (temporal, height, width) sections of the head_dim / 2 = 8 frequencies,
        # interleaved as in the real config ([24, 20, 20] of 64)
        text=dict(
            _TEXT,
            intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters=dict(
                rope_type="default", rope_theta=5_000_000.0, mrope_section=[4, 2, 2], mrope_interleaved=True
            ),
        ),
        # deepstack: the first block's features are also added to the first language layer
        vision=dict(_VISION, deepstack_visual_indexes=[0]),
    ),
    "qwen3_5_moe": VLDemo(
        model_type="qwen3_5_moe",
        template="qwen3_5_nothink",
        text=dict(
            _TEXT,
            layer_types=["linear_attention", "full_attention"],  # hybrid: Gated DeltaNet + attention
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            shared_expert_intermediate_size=32,
            # partial rotary 0.5 of head_dim 16: 4 frequencies in (t, h, w) sections
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10_000_000.0,
                partial_rotary_factor=0.5,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
        ),
        vision=dict(_VISION),
    ),
}


def draw_shape(color: str, shape: str, rnd: random.Random, side: int = IMAGE_SIDE):
    """A ``side`` x ``side`` RGB PIL image: one filled ``shape`` of ``color`` on white, at a random
    offset and size (so the model cannot read the answer off fixed pixels)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    size = rnd.randint(side // 2, side - 12)
    x0, y0 = rnd.randint(2, side - size - 2), rnd.randint(2, side - size - 2)
    x1, y1 = x0 + size, y0 + size
    fill = COLORS[color]
    if shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
    else:
        draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) // 2, y0)], fill=fill)
    return image


def demo_vl_examples(data_dir: Path, n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """Draw ``n`` images under ``data_dir/images`` and return their sharegpt examples:
    ``{"messages": [user "<image>question", assistant answer], "images": ["images/NNN.png"]}``."""
    rnd = random.Random(seed)
    (data_dir / "images").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        color, shape = rnd.choice(list(COLORS)), rnd.choice(SHAPES)
        path = f"images/{i:03d}.png"
        draw_shape(color, shape, rnd).save(data_dir / path)
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"<image>{question}"},
                    {"role": "assistant", "content": answer.format(color=color, shape=shape)},
                ],
                "images": [path],
            }
        )
    return out


def dataset_info(name: str = DATASET_NAME) -> dict[str, Any]:
    """LLaMA-Factory's ``dataset_info.json`` entry of dataset ``name`` (sharegpt messages, an images
    column; the file ``name.json``)."""
    return {
        name: {
            "file_name": f"{name}.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
            },
        }
    }


def vl_config(family: str, tokenizer, **text_overrides):
    """The tiny composite config of ``family`` (a key of ``VL_DEMOS``), token ids from ``tokenizer``."""
    from transformers import AutoConfig

    demo = VL_DEMOS[family]
    tokens = dict(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    vision_ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in zip(VISION_TOKEN_KEYS, VISION_TOKENS)}
    return AutoConfig.for_model(
        demo.model_type,
        text_config={**demo.text, **tokens, **text_overrides},
        vision_config=dict(demo.vision),
        tie_word_embeddings=False,
        **vision_ids,
    )


def make_processor(tokenizer):
    """A ``Qwen3VLProcessor`` for the demo: patch 16, 2x2 merge, 2 frames a temporal patch, pixel
    values normalised with mean = std = 0.5; between 32x32 and 256x256 pixels an image."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    geometry = dict(patch_size=16, merge_size=2, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(
        **geometry,
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(**geometry)
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=tokenizer.chat_template,
    )


def make_demo_vl_model(
    out_dir: str | Path, family: str = "qwen3_vl_moe", seed: int = 0, dtype: str = "float32", n: int = 64
) -> Path:
    """Write ``out_dir/model`` (config, weights, tokenizer, processor) and ``out_dir/data`` (images,
    dataset, dataset_info.json); returns ``out_dir``. ``family``: a key of ``VL_DEMOS``."""
    import torch
    from transformers import AutoModelForImageTextToText

    if family not in VL_DEMOS:
        raise KTConfigError(
            f"--family {family!r}: no vision-language demo; valid choices: {', '.join(VL_DEMOS)}"
        )
    out = Path(out_dir)
    data_dir, model_dir = out / "data", out / "model"
    examples = demo_vl_examples(data_dir, n=n, seed=seed)
    (data_dir / f"{DATASET_NAME}.json").write_text(json.dumps(examples, indent=1))
    (data_dir / "dataset_info.json").write_text(json.dumps(dataset_info(), indent=2))

    texts = [m["content"].removeprefix("<image>") for e in examples for m in e["messages"]]
    special = VISION_TOKENS + template_stop_words(VL_DEMOS[family].template)
    tokenizer = train_tokenizer(texts + ["user assistant system"], vocab_size=400, extra_special=special)
    config = vl_config(family, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir)
    make_processor(tokenizer).save_pretrained(model_dir)  # tokenizer files + processor_config.json
    return out


__all__ = ["DATASET_NAME", "SPECIAL_TOKENS", "VL_DEMOS", "make_demo_vl_model"]
