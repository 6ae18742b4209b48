"""The tiny vision-language demo's LLaMA-Factory training run, in this process (tests only).

``run_exp`` is what ``llamafactory-cli train`` calls: LLaMA-Factory's import is paid once per
test process and each run of the tiny demo takes about a second.
"""

from __future__ import annotations

from pathlib import Path


def train(assets: Path, out: Path, **overrides) -> Path:
    """One ``llamafactory-cli train`` of the demo recipe, in this process; returns ``out``."""
    from llamafactory.train.tuner import run_exp

    args = dict(
        model_name_or_path=str(assets / "model"),
        stage="sft",
        do_train=True,
        finetuning_type="lora",
        lora_rank=8,
        lora_alpha=16,
        lora_target="all",
        use_kt=True,
        cpu_infer=2,
        chunk_size=256,
        kt_backend="torch",
        dataset_dir=str(assets / "data"),
        dataset="kt_demo_vl",
        template="qwen3_vl_nothink",
        cutoff_len=128,
        image_max_pixels=4096,
        max_samples=16,
        overwrite_cache=True,
        preprocessing_num_workers=1,
        dataloader_num_workers=0,
        output_dir=str(out),
        logging_steps=1,
        save_steps=2,
        overwrite_output_dir=True,
        plot_loss=False,
        report_to="none",
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        # AdamW's default eps (1e-8) turns rounding-level gradient differences of near-zero
        # entries into full lr-sized steps; 1e-3 keeps runs that differ only in summation order
        # comparable step by step (as helpers/resident.py's adamw)
        adam_epsilon=1e-3,
        max_steps=4,
        lr_scheduler_type="constant",
        seed=42,
        bf16=False,
    )
    run_exp({**args, **overrides})
    return out
