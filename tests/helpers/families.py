"""What a family's config says about its layers (tests/test_families.py, tests/test_cli_train.py)."""

from __future__ import annotations


def moe_layers(config) -> list[int]:
    """Indices of the decoder layers with routed experts, from the config alone (dense layers
    excluded: ``first_k_dense_replace``, ``mlp_only_layers``, ``decoder_sparse_step``), ascending."""
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [
        i
        for i in range(config.num_hidden_layers)
        if i >= first_dense and i not in dense and (i + 1) % step == 0
    ]
