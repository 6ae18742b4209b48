"""In-process LLaMA-Factory loads of the demo model with kt-ft (tests only)."""

from __future__ import annotations

import torch

TOKENS = torch.tensor([[5, 17, 33, 2, 41, 8, 9, 60, 12, 3]])


def lf_load(demo_assets, trainable, model_dir=None, **overrides):
    """LLaMA-Factory's load_model with use_kt (train args when ``trainable``, else infer args)."""
    from llamafactory.hparams import get_infer_args, get_train_args
    from llamafactory.model import load_model, load_tokenizer

    args = dict(
        model_name_or_path=str(model_dir or demo_assets / "model"),
        template="qwen",
        finetuning_type="lora",
        use_kt=True,
        cpu_infer=1,
        kt_backend="torch",
    )
    args.update(overrides)
    if trainable:
        args.update(stage="sft", do_train=True, lora_target="all", lora_rank=8, lora_alpha=16,
                    dataset_dir=str(demo_assets / "data"), dataset="kt_demo", report_to="none")  # fmt: skip
        model_args, _, _, finetuning_args, _ = get_train_args(args)
    else:
        model_args, _, finetuning_args, _ = get_infer_args(args)
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    return load_model(tokenizer, model_args, finetuning_args, is_trainable=trainable)


def logits(model) -> torch.Tensor:
    """The model's logits on ``TOKENS`` without grad: [1, 10, vocab] float32."""
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def random_lora_adapter(demo_assets, out):
    """A kt model whose every LoRA tensor is random (B non-zero), saved to ``out`` through the
    hooked save_pretrained. Returns (model, its logits on TOKENS, copies of its trainable params)."""
    model = lf_load(demo_assets, True, output_dir=str(out.parent / "train"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.eval()
    ref = logits(model)
    model.save_pretrained(str(out))
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return model, ref, state
