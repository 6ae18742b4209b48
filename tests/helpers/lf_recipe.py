"""The demo's LLaMA-Factory training arguments as a dict, for in-process parsing and loading
(tests/test_llamafactory.py, tests/test_fsdp.py)."""

from __future__ import annotations


def recipe(demo_assets, tmp_path, **overrides) -> dict:
    """Arguments for LLaMA-Factory's ``get_train_args``: SFT with LoRA on every linear layer (rank 8)
    of the demo model in ``demo_assets`` on its ``kt_demo`` dataset, use_kt with one CPU thread,
    output to ``tmp_path / "out"``; ``overrides`` replace or add keys. Returns a new dict of
    key -> str / int / bool."""
    args = dict(
        model_name_or_path=str(demo_assets / "model"),
        stage="sft",
        do_train=True,
        finetuning_type="lora",
        lora_target="all",
        lora_rank=8,
        dataset_dir=str(demo_assets / "data"),
        dataset="kt_demo",
        template="qwen",
        cutoff_len=64,
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_kt=True,
        cpu_infer=1,
    )
    args.update(overrides)
    return args
