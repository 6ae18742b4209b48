"""A tiny random config of any model type, made from its config class's defaults.

For the model types kt-ft derives from transformers' experts interface (``interface.py``) there
is no hand-written demo config: the config class's defaults are shrunk instead -- every key of
``SHRINK`` the class has is set (hidden 64, 2 layers, 8 experts top-2, vocab 97, 4 heads of 16,
...), the rest stays the class default -- and ``TYPE_OVERRIDES`` adds what a type needs to build
and to keep its structure at that size (a full-attention layer in a hybrid stack, an MoE layer
among its dense ones). Composite configs (a ``text_config`` sub-config) get the shrunk keys
in their text config.
"""

from __future__ import annotations

from typing import Any

# Keys set wherever the config class has them (its own key or an attribute_map alias).
SHRINK: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,  # dense MLPs; the experts' own size where a type has no moe key
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    n_routed_experts=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    top_k_experts=2,
    n_shared_experts=1,
    first_k_dense_replace=1,  # one dense layer then MoE, where the type has dense layers first
    n_group=1,
    topk_group=1,
    # multi-head latent attention (DeepSeek-style): small ranks, head_dim = the rope part
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=97,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# What a type needs beyond SHRINK (why, per line).
TYPE_OVERRIDES: dict[str, dict[str, Any]] = {
    # MLA: HF's rotary embedding takes head_dim, which must be the rope part; keys carry every
    # head, so num_key_value_heads must equal num_attention_heads (SDPA with a padding mask
    # repeats the keys by heads // kv_heads and fails otherwise)
    "deepseek_v2": dict(num_key_value_heads=4),
    "deepseek_v3": dict(head_dim=8, num_key_value_heads=4),
    "glm4_moe_lite": dict(head_dim=8, num_key_value_heads=4),
    "glm_moe_dsa": dict(
        head_dim=8,
        num_key_value_heads=4,
        mlp_layer_types=["dense", "sparse"],
        index_head_dim=16,
        index_n_heads=2,
    ),  # fmt: skip
    "mistral4": dict(head_dim=8, num_key_value_heads=4),
    # the MoE block is off by default; its experts use moe_intermediate_size
    "gemma4_text": dict(
        enable_moe_block=True,
        global_head_dim=16,
        hidden_size_per_layer_input=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    ),  # fmt: skip
    # hybrid stacks: one linear-attention / mamba layer and one full-attention layer
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
}


def tiny_config(model_type: str, **overrides):
    """A transformers config of ``model_type``: its class defaults, shrunk (``SHRINK``, the type's
    ``TYPE_OVERRIDES``, then ``overrides``)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    text = default.get_text_config() if hasattr(default, "get_text_config") else default
    keys = set(text.to_dict()) | set(getattr(type(text), "attribute_map", {}))
    shrunk = {k: v for k, v in SHRINK.items() if k in keys}
    shrunk |= TYPE_OVERRIDES.get(model_type, {}) | overrides
    if "vocab_size_per_layer_input" in keys:
        # Gemma's per-layer embeddings are indexed by the same token ids as embed_tokens: they follow
        # vocab_size (make-demo-model sets it to its tokenizer's size) unless set explicitly.
        shrunk.setdefault("vocab_size_per_layer_input", shrunk["vocab_size"])
    if text is not default:  # composite: the language model's keys go to its text config
        return AutoConfig.for_model(model_type, text_config=shrunk)
    return AutoConfig.for_model(model_type, **shrunk)
