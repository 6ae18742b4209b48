"""Tiny offline demo assets: a random MoE model, a locally trained tokenizer, a dataset.

Nothing is downloaded: the model comes from a config (``models.FAMILIES[f].demo_config``,
built as ``FAMILIES[f].demo_type``: the text-only model type where the real checkpoints are
vision-language composites; for a model type kt-ft derives from transformers' experts interface,
its config class's defaults shrunk by ``models/tiny.py``), the tokenizer is a byte-level BPE trained on the demo dataset
with ``tokenizers``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.families import FAMILIES, UNSUPPORTED
from kt_ft.plan.family import family_of
from kt_ft.plan.tiny import tiny_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DATASET_NAME = "kt_demo"
WORDS = ["cat", "dog", "sun", "tree", "river", "stone", "cloud", "bird", "fish", "moon", "star", "leaf"]


def demo_examples(n: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """Small, learnable instruction data (arithmetic, word reversal, counting), alpaca format."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            a, b = rnd.randint(0, 20), rnd.randint(0, 20)
            out.append(
                {"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} plus {b} is {a + b}."}
            )
        elif kind == 1:
            w = rnd.choice(WORDS)
            out.append(
                {
                    "instruction": "Reverse the word.",
                    "input": w,
                    "output": f"The reverse of {w} is {w[::-1]}.",
                }
            )
        else:
            ws = rnd.sample(WORDS, rnd.randint(1, 5))
            out.append(
                {
                    "instruction": "How many words are in the list?",
                    "input": " ".join(ws),
                    "output": f"There are {len(ws)} words.",
                }
            )
    return out


def template_stop_words(template: str) -> list[str]:
    """The stop words of LLaMA-Factory's chat ``template`` (none without LLaMA-Factory).

    LLaMA-Factory makes them the tokenizer's eos / additional special tokens and adds each one the
    tokenizer lacks, which puts its id past the model's embeddings (an IndexError in the forward
    unless ``resize_vocab``); a demo tokenizer that has them trains with the family's own template."""
    if not template:
        return []
    try:
        from llamafactory.data.template import TEMPLATES
    except ImportError:
        return []
    found = TEMPLATES.get(template)
    return list(found.stop_words) if found else []


def train_tokenizer(texts: list[str], vocab_size: int, extra_special: list[str] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + [t for t in extra_special if t not in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def _check_derived(model_type: str):
    """A model type without a hand-written family: kt-ft must derive one (else KTConfigError with
    why); returns it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise KTConfigError(
            f"--family {model_type!r} is not a model type of this transformers; valid choices: "
            f"{', '.join(FAMILIES)} or a model type listed in docs/models.md"
        )
    return family_of(tiny_config(model_type))


def make_demo_model(
    out_dir: str | Path, family: str = "qwen3_moe", seed: int = 0, dtype: str = "float32", **config_overrides
) -> Path:
    """Write ``out_dir/model`` (config, weights, tokenizer) and ``out_dir/data`` (dataset + info).

    ``config_overrides`` replace keys of the family's demo config (e.g. ``num_experts=64,
    moe_intermediate_size=1536`` for larger routed experts)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family in UNSUPPORTED:
        raise KTConfigError(f"--family {family!r} is not supported by kt-ft: {UNSUPPORTED[family]}")
    template = FAMILIES[family].template if family in FAMILIES else _check_derived(family).template
    out = Path(out_dir)
    data_dir, model_dir = out / "data", out / "model"
    data_dir.mkdir(parents=True, exist_ok=True)
    examples = demo_examples(seed=seed)
    (data_dir / f"{DATASET_NAME}.json").write_text(json.dumps(examples, indent=1))
    (data_dir / "dataset_info.json").write_text(
        json.dumps({DATASET_NAME: {"file_name": f"{DATASET_NAME}.json"}}, indent=2)
    )

    texts = [f"{e['instruction']} {e['input']} {e['output']}" for e in examples] + ["user assistant system"]
    tokenizer = train_tokenizer(texts, vocab_size=400, extra_special=template_stop_words(template))
    # Special tokens are the tokenizer's (ChatML-style for every family: the demo recipe's
    # template is `qwen`; plus the stop words of the family's template, so it works too); the
    # family's own bos/eos ids would point outside the small vocab.
    tokens = dict(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if family in FAMILIES:
        fam = FAMILIES[family]
        config = AutoConfig.for_model(fam.demo_type, **tokens, **{**fam.demo_config, **config_overrides})
    else:  # a type derived from transformers' experts interface: its config class's defaults, shrunk
        config = tiny_config(family, **tokens, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # HF inits gpt_oss's expert biases to zero; a real checkpoint's are not
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.normal_(0, 0.02)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return out


def randomize_routing(model) -> None:
    """HF inits some routers (and DeepSeek-style score biases) to zero: give them real values so the
    experts a token picks differ between tokens."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            leaf = n.rsplit(".", 2)
            if len(leaf) == 3 and leaf[1] in ("gate", "router", "proj") and "experts" not in n:
                if leaf[1] != "proj" or ".router." in n:
                    p.normal_(0, 0.5)
        for n, b in model.named_buffers():
            if n.endswith(("e_score_correction_bias", "expert_bias")) and b.is_floating_point():
                b.normal_(0, 0.1)
