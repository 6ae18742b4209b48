"""`kt-ft bench --parts e2e`: what every run trains on, written once under ``--workdir``.

A random-weight model of a preset's real config (``models.py``; a vision-language preset's
through ``vl_assets.py``), a tokenizer trained here on the generated text, the alpaca dataset of
long (or ``--e2e-lengths varied``) examples, and ``kt-ft quantize`` copies of the model for the
``+<format>`` systems.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

from kt_ft.integrations.bench.models import MODEL_CONFIGS, build_model_dir
from kt_ft.integrations.bench.vl_assets import is_vl, real_layers, write_vl_assets
from kt_ft.integrations.demo.text import train_tokenizer

DATASET = "kt_e2e"
_SYLLABLES = "ka to ri mu se lo na vi pe du shi gor tan bel qua zen".split()


def _words(rnd: random.Random, n: int) -> list[str]:
    return ["".join(rnd.choice(_SYLLABLES) for _ in range(rnd.randint(1, 3))) for _ in range(n)]


LENGTHS = ("cutoff", "varied")  # the dataset's example lengths (``write_assets``)


def write_assets(
    workdir: Path,
    preset: str,
    layers: int | None,
    cutoff_len: int,
    examples: int,
    seed: int = 0,
    lengths: str = "cutoff",
) -> tuple[Path, Path, int]:
    """``workdir/model`` (random bf16 weights of ``preset`` at ``layers`` decoder layers, and a
    tokenizer trained here) and ``workdir/data`` (``examples`` alpaca examples, each longer than
    ``cutoff_len`` tokens; ``lengths="varied"``: of uniformly random lengths from about
    ``cutoff_len / 4`` up). Kept and reused when ``workdir/assets.json`` says they match.
    Returns (model dir, data dir, layers)."""
    if lengths not in LENGTHS:
        raise ValueError(f"--e2e-lengths {lengths!r}: valid choices: {', '.join(LENGTHS)}")
    real = real_layers(preset) if is_vl(preset) else MODEL_CONFIGS[preset][1]["num_hidden_layers"]
    layers = real if layers is None else layers
    if not 1 <= layers <= real:
        raise ValueError(f"--layers {layers}: {preset} has {real} decoder layers (valid: 1..{real})")
    model_dir, data_dir = workdir / "model", workdir / "data"
    want = {"preset": preset, "layers": layers, "cutoff_len": cutoff_len, "examples": examples, "seed": seed}
    if lengths != "cutoff":
        want["lengths"] = lengths
    stamp = workdir / "assets.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == want and (model_dir / "config.json").is_file():
        print(f"reusing {model_dir} and {data_dir} ({stamp})")
        return model_dir, data_dir, layers
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    vocab_words = _words(rnd, 4000)
    # ~1.5 tokens a word once the tokenizer has merged the syllables: 2x cutoff words is plenty;
    # the length is checked below with the trained tokenizer
    texts = [" ".join(rnd.choice(vocab_words) for _ in range(2 * cutoff_len)) for _ in range(examples)]
    if is_vl(preset):  # pictures with long answers; the tokenizer and processor of a VL model
        write_vl_assets(workdir, preset, layers, cutoff_len, examples, texts, DATASET, seed)
        stamp.write_text(json.dumps(want))
        return model_dir, data_dir, layers
    # no larger than the model's vocabulary: LLaMA-Factory would resize the embeddings otherwise
    vocab = min(2048, MODEL_CONFIGS[preset][1]["vocab_size"])
    tokenizer = train_tokenizer(texts[:64] + ["user assistant system"], vocab_size=vocab)
    counts = [len(tokenizer(t)["input_ids"]) for t in texts]
    if lengths == "varied":  # each cut to a random cutoff_len / 4 .. cutoff_len tokens (by its words)
        for i, (t, n) in enumerate(zip(texts, counts)):
            words = t.split()
            texts[i] = " ".join(words[: len(words) * rnd.randint(cutoff_len // 4, cutoff_len) // n])
        counts = [len(tokenizer(t)["input_ids"]) for t in texts]
    shortest = min(counts)
    if lengths == "varied":
        print(f"example lengths {shortest}..{max(counts)} tokens (cutoff_len {cutoff_len})")
    elif shortest <= cutoff_len:
        raise RuntimeError(f"generated examples are too short: {shortest} tokens <= cutoff_len {cutoff_len}")
    data_dir.mkdir(parents=True)
    rows = [{"instruction": "Continue the text.", "input": "", "output": t} for t in texts]
    (data_dir / f"{DATASET}.json").write_text(json.dumps(rows))
    (data_dir / "dataset_info.json").write_text(json.dumps({DATASET: {"file_name": f"{DATASET}.json"}}))
    t0 = time.perf_counter()
    build_model_dir(preset, layers, model_dir, seed=seed)
    _point_config_at_tokenizer(model_dir, tokenizer)
    tokenizer.model_max_length = max(cutoff_len * 2, 4096)
    tokenizer.save_pretrained(model_dir)
    print(
        f"wrote {preset} x{layers} layers to {model_dir} in {time.perf_counter() - t0:.0f} s; {examples} examples"
    )
    stamp.write_text(json.dumps(want))
    return model_dir, data_dir, layers


def write_quantized(model_dir: Path, fmt: str) -> Path:
    """``kt-ft quantize --format fmt`` of ``model_dir`` into its sibling ``model-<fmt>`` (rewritten each
    time; quantized on the GPU when there is one). Returns that directory."""
    import torch

    from kt_ft.integrations.export.quantize import (
        quantize_checkpoint,  # why: torch loads only in the child that quantizes
    )

    out = model_dir.parent / f"model-{fmt}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    c = quantize_checkpoint(model_dir, out, fmt, device="cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"wrote {out} (kt-ft quantize --format {fmt}: {c['bytes_in'] / 2**30:.1f} GiB -> "
        f"{c['bytes_out'] / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s"
    )
    return out


def _point_config_at_tokenizer(model_dir: Path, tokenizer) -> None:
    """The config's special token ids are the local tokenizer's (the real ones lie outside its vocab)."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    path.write_text(json.dumps(cfg, indent=2))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        g.update(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        gen.write_text(json.dumps(g, indent=2))
