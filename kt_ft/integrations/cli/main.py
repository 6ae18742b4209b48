"""The ``kt-ft`` command: make-demo-model, make-demo-vl-model, models, bench, rules (list / check / plan), convert, merge.

Each subcommand imports what it needs when it runs (``# why: lazy CLI``): ``kt-ft --help``
and a mistyped command answer without loading torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kt_ft.base.errors import KTConfigError


def _make_demo_model(args: argparse.Namespace) -> int:
    from kt_ft.integrations.demo.text import make_demo_model  # why: lazy CLI

    out = make_demo_model(args.dir, family=args.family, seed=args.seed, dtype=args.dtype)
    print(f"wrote {out}/model (tiny random {args.family}) and {out}/data (dataset_info.json, kt_demo.json)")
    return 0


def _make_demo_vl_model(args: argparse.Namespace) -> int:
    from kt_ft.integrations.demo.vision import make_demo_vl_model  # why: lazy CLI

    out = make_demo_vl_model(args.dir, family=args.family, seed=args.seed, dtype=args.dtype)
    print(
        f"wrote {out}/model (tiny random {args.family} with its processor) and {out}/data "
        "(dataset_info.json, kt_demo_vl.json, images/)"
    )
    return 0


def _models(args: argparse.Namespace) -> int:
    """Probe every experts-interface model type of this transformers (``models/probe.py``)."""
    import transformers  # why: lazy CLI

    from kt_ft.integrations.cli.probe import (  # why: lazy CLI
        interface_model_types,
        models_markdown,
        probe,
        update_readme,
    )

    types = args.types.split(",") if args.types else interface_model_types()
    rows = []
    for t in types:
        row = probe(t)
        rows.append(row)
        print(
            f"{row.model_type}\t{row.status}\t{row.layout or row.detail[:160]}\t{row.seconds:.1f}s",
            flush=True,
        )
    if args.lf:
        _lf_cells(rows, args.lf_dir, args.lf_jobs)
    if args.write:
        Path(args.write).write_text(models_markdown(rows, transformers.__version__))
        print(f"wrote {args.write}")
        if args.readme:
            update_readme(Path(args.readme), Path(args.write).read_text())
            print(f"updated {args.readme}'s model-types sentence")
    return 0 if all(r.status != "error" and not r.lf.startswith("fail") for r in rows) else 1


def _lf_cells(rows, lf_dir: str | None, jobs: int) -> None:
    """Fill each row's LLaMA-Factory column, ``jobs`` types at a time: a type's two runs wait mostly
    on their subprocesses (threads suffice; ``lf_check`` makes one demo at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(row):
        row.lf = _lf_cell(row, lf_dir)
        print(f"{row.model_type}\tLLaMA-Factory: {row.lf}", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, rows))


def _lf_cell(row, lf_dir: str | None) -> str:
    """``kt-ft models --lf``: the LLaMA-Factory lr-0 parity of one probed type (``lf_check.py``),
    its recipes, logs and outputs under ``lf_dir/<type>`` (a temporary directory without it)."""
    import tempfile

    from kt_ft.integrations.cli.lf_check import lf_parity  # why: lazy CLI

    if row.status != "supported":
        return f"not run ({row.status})"
    if lf_dir:
        return lf_parity(row.model_type, Path(lf_dir) / row.model_type).cell()
    with tempfile.TemporaryDirectory(prefix=f"kt-ft-lf-{row.model_type}-") as tmp:
        return lf_parity(row.model_type, Path(tmp)).cell()


def _settings(args: argparse.Namespace) -> int:
    """Every KT_FT_* environment switch: the registry's table (docs/settings.md carries it)."""
    from kt_ft.base.settings import markdown_table  # why: lazy CLI

    print(markdown_table(), end="")
    return 0


def _rules_list(args: argparse.Namespace) -> int:
    from kt_ft.plan.builtin import builtin_rule_names, resolve_rule_path  # why: lazy CLI

    for name in builtin_rule_names():
        print(f"{name}\t{resolve_rule_path(name)}")
    return 0


def _rule_and_model(
    rule: str, model_dir: str | None, cpu_infer: int | None, kt_backend: str = "auto", cuda_count=None
):
    from kt_ft.runtime.rules_plan import rule_and_model  # why: lazy CLI

    return rule_and_model(rule, model_dir, cpu_infer, kt_backend, cuda_count)


def _rules_check(args: argparse.Namespace) -> int:
    from kt_ft.plan.placement import cuda_device_count  # why: lazy CLI

    rules, _, plan, _ = _rule_and_model(args.file, args.model, None, cuda_count=cuda_device_count())
    extra = f" ({len(rules.includes)} included files)" if rules.includes else ""
    what = f"; matches {args.model}: {len(plan.experts)} routed-experts modules" if plan else ""
    print(f"{rules.source}: {len(rules.rules)} rules{extra}, default device {rules.default_device}{what}: OK")
    for r in plan.refusals if plan else []:
        print(f"warning: refused at load in this version: {r}")
    return 0


def _rules_plan(args: argparse.Namespace) -> int:
    import json

    from kt_ft.runtime.rules_plan import PlanRequest, fits, format_plan, plan_report  # why: lazy CLI

    report = plan_report(
        PlanRequest(
            rule=args.rule,
            model=args.model,
            gpu_mem=args.gpu_mem,
            cpu_mem=args.cpu_mem,
            cutoff_len=args.cutoff_len,
            batch=args.batch,
            lora_rank=args.lora_rank,
            pure_bf16=args.pure_bf16,
            cpu_infer=args.cpu_infer,
            kt_backend=args.kt_backend,
            rates=args.rates,
            remeasure=args.remeasure,
        )
    )
    print(json.dumps(report, indent=2) if args.json else format_plan(report, args.model))
    return 0 if fits(report) else 1


def _bench(args: argparse.Namespace) -> int:
    from kt_ft.integrations.bench.models import MODEL_CONFIGS  # why: lazy CLI
    from kt_ft.integrations.bench.op import (  # why: torch on use only
        OP_FORMATS,
        PRESETS,
        available_backends,
        run,
        write_json,
    )
    from kt_ft.integrations.bench.step import STEP_SYSTEMS, run_step, worker_flags  # why: lazy CLI
    from kt_ft.integrations.bench.vl_assets import VL_PRESETS  # why: lazy CLI

    parts = args.parts.split(",")
    if args.preset in VL_PRESETS and parts != ["e2e"]:
        raise KTConfigError(f"--preset {args.preset!r} (vision-language) runs with --parts e2e only")
    known = [*PRESETS, *(m for m in MODEL_CONFIGS if m not in PRESETS), *VL_PRESETS]
    if args.preset not in known:
        raise KTConfigError(f"--preset {args.preset!r} is unknown; valid choices: {', '.join(known)}")
    if "op" in parts and args.preset not in PRESETS:
        raise KTConfigError(
            f"--preset {args.preset!r} has no op layer; the op part's presets: {', '.join(PRESETS)}"
        )
    for part in parts:
        if part not in ("op", "step", "placement", "e2e", "gen"):
            raise KTConfigError(
                f"--parts {args.parts!r}: {part!r} is unknown; valid choices: op, step, placement, e2e, gen"
            )
    if (
        "gen" in parts
    ):  # generation through LF's do_predict, kt-ft against merged (kt_ft/integrations/bench/generate.py)
        from kt_ft.integrations.bench.generate import run_generate  # why: LF runs only

        try:
            run_generate(preset=args.preset, layers=int(args.layers) if args.layers else None,
                         system=args.gen_system, workdir=Path(args.workdir), threads=args.threads or 1,
                         samples=args.gen_samples, batch=args.gen_batch, prompt_len=args.gen_prompt,
                         max_new_tokens=args.gen_new_tokens, timeout_s=args.run_timeout,
                         json_path=args.json if parts == ["gen"] else None,
                         merged_dir=Path(args.gen_merged_dir) if args.gen_merged_dir else None)  # fmt: skip
        except ValueError as e:
            raise KTConfigError(str(e)) from None
        parts = [p for p in parts if p != "gen"]
        if not parts:
            return 0
    if (
        "e2e" in parts
    ):  # the product path: `llamafactory-cli train` per system (kt_ft/integrations/bench/e2e.py)
        from kt_ft.integrations.bench.e2e import run_e2e  # why: LF runs only
        from kt_ft.integrations.bench.e2e_systems import DEFAULT_SYSTEMS, parse_systems  # why: LF runs only

        try:
            e2e_systems = parse_systems(args.e2e_systems or DEFAULT_SYSTEMS)
        except ValueError as e:
            raise KTConfigError(str(e)) from None
        if args.e2e_rounds < 1:
            raise KTConfigError(f"--e2e-rounds {args.e2e_rounds}: at least 1 (passes over the systems)")
        layers = int(args.layers) if args.layers else None
        run_e2e(preset=args.preset, layers=layers, systems=e2e_systems, workdir=Path(args.workdir),
                cutoff_len=args.seq, steps=args.e2e_steps, grad_accum=args.grad_accum, threads=args.threads,
                cpu_infer=args.cpu_infer,
                timeout_s=args.run_timeout, json_path=args.json if parts == ["e2e"] else None,
                peer_site=args.peer_site, lengths=args.e2e_lengths, rounds=args.e2e_rounds)  # fmt: skip
        parts = [p for p in parts if p != "e2e"]
        if not parts:
            return 0
    try:
        caps = [float(c) for c in args.caps.split(",")]
    except ValueError:
        caps = []
    if not caps or any(not c > 0 for c in caps):
        raise KTConfigError(
            f"--caps {args.caps!r}: expected comma-separated positive GiB, e.g. 8,16,24,40,80"
        )
    placements = args.placements.split(",")
    for pl in placements:
        if pl not in ("cpu", "auto", "stream"):
            raise KTConfigError(
                f"--placements {args.placements!r}: {pl!r} is unknown; valid choices: cpu, auto, stream"
            )
    systems = args.systems.split(",")
    for s in systems:
        if s not in STEP_SYSTEMS:
            raise KTConfigError(
                f"--systems {args.systems!r}: {s!r} is unknown; valid choices: {', '.join(STEP_SYSTEMS)}"
            )
    backends = available_backends(args.backends.split(",") if args.backends else None)
    flags = worker_flags(args.profile, args.trace, args.replan)  # the step and placement workers'
    records: list = []
    if "op" in parts:
        formats = tuple(args.formats.split(","))
        bad = [f for f in formats if f not in OP_FORMATS]
        if bad:
            raise KTConfigError(
                f"--formats {args.formats!r}: {bad[0]!r} is unknown; valid choices: {', '.join(OP_FORMATS)}"
            )
        records += run(
            args.preset,
            [int(t) for t in args.tokens.split(",")],
            backends,
            args.threads,
            args.repeat,
            formats,
        )
    if "step" in parts:
        step_backends = [b for b in backends if b != "reference"]  # the plain loop: minutes per step
        layers = [int(v) for v in args.layers.split(",")] if args.layers else None
        records += run_step(args.preset, layers, args.seq, systems, step_backends, args.threads,
                            args.steps, args.gpu_cap, worker_flags=flags)  # fmt: skip
    if "placement" in parts:
        from kt_ft.integrations.bench.placement import (  # why: placement runs only
            plot_placement,
            run_placement,
        )

        layers = [int(v) for v in args.layers.split(",")] if args.layers else [None]
        step_backends = [b for b in backends if b != "reference"] or ["auto"]
        placed = run_placement(args.preset, layers[-1], args.seq, caps, step_backends[0], args.threads, args.steps,
                               all_gpu="peft-gpu" in systems, kt_kernel="kt-kernel" in step_backends,
                               placements=placements, worker_flags=flags)  # fmt: skip
        records += placed
        if args.plot and placed:
            plot_placement(placed, args.plot)
    if args.json:
        write_json(args.json, args.threads, records)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from kt_ft.integrations.export.convert import convert_adapter  # why: lazy CLI

    for d in convert_adapter(args.dir, args.out, split=args.split):
        print(f"wrote {d}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from kt_ft.integrations.export.merge import merge_adapter  # why: lazy CLI

    print(f"wrote {merge_adapter(args.dir, args.out, base=args.base)}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from kt_ft.integrations.export.quantize import quantize_checkpoint  # why: lazy CLI

    c = quantize_checkpoint(args.model, args.out, args.format)
    print(
        f"wrote {args.out}: {c.get('quantized', 0)} weights in {args.format}, {c.get('kept', 0)} tensors kept, "
        f"{c['bytes_in'] / 2**20:.1f} MiB -> {c['bytes_out'] / 2**20:.1f} MiB"
    )
    return 0


def _dequantize(args: argparse.Namespace) -> int:
    from kt_ft.integrations.export.quantize import dequantize_checkpoint  # why: lazy CLI

    c = dequantize_checkpoint(args.model, args.out, args.dtype)
    print(f"wrote {args.out}: {c.get('dequantized', 0)} weights dequantized to {args.dtype}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kt_ft.base.version import __version__  # why: lazy CLI

    p = argparse.ArgumentParser(
        prog="kt-ft", description="kt-ft: MoE LoRA fine-tuning with experts on the CPU"
    )
    p.add_argument("--version", action="version", version=f"kt-ft {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "make-demo-model", help="write a tiny random MoE model, tokenizer and dataset (offline)"
    )
    demo.add_argument("dir", help="output directory (gets model/ and data/)")
    demo.add_argument("--family", default="qwen3_moe", help="model family (transformers model_type)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    demo.set_defaults(func=_make_demo_model)

    demo_vl = sub.add_parser(
        "make-demo-vl-model",
        help="write a tiny random vision-language MoE model, its processor and an image dataset (offline)",
    )
    demo_vl.add_argument("dir", help="output directory (gets model/ and data/)")
    demo_vl.add_argument(
        "--family", default="qwen3_vl_moe", choices=["qwen3_vl_moe", "qwen3_5_moe"], help="model type"
    )
    demo_vl.add_argument("--seed", type=int, default=0)
    demo_vl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    demo_vl.set_defaults(func=_make_demo_vl_model)

    models = sub.add_parser(
        "models",
        help="which model types of this transformers kt-ft fine-tunes: derive, refuse or check each on a tiny model",
    )
    models.add_argument("--types", default=None, help="comma-separated model types (default: every one whose "
                        "experts use transformers' experts interface)")  # fmt: skip
    models.add_argument("--write", default=None, help="also write the markdown table here (docs/models.md)")
    models.add_argument(
        "--readme",
        default=None,
        help="with --write: also regenerate README.md's model-types sentence from it",
    )
    models.add_argument("--lf", action="store_true", help="also train each supported type's demo through "
                        "`llamafactory-cli train` with use_kt true and false (learning rate 0) and compare "
                        "the losses (minutes)")  # fmt: skip
    models.add_argument("--lf-dir", default=None, help="with --lf: keep each type's demo, recipes and logs "
                        "under DIR/<type> (default: a temporary directory)")  # fmt: skip
    models.add_argument("--lf-jobs", type=int, default=1, help="with --lf: types checked at once (each runs "
                        "two llamafactory-cli processes side by side)")  # fmt: skip
    models.set_defaults(func=_models)

    bench = sub.add_parser(
        "bench", help="benchmark the CPU expert op (every available backend) and GEMM ceilings"
    )
    bench.add_argument(
        "--preset", default="tiny", help="tiny | qwen3-30b-a3b | deepseek-v2-lite | deepseek-v3 (op)"
    )
    bench.add_argument(
        "--formats",
        default="bf16",
        help="op part: comma-separated storage of the layer's experts: bf16, fp8, int8, int4, mxfp4 "
        "(quantized ones run on the backends that compute them)",
    )
    bench.add_argument("--tokens", default="512,2048,4096", help="comma-separated token counts per call")
    bench.add_argument("--backends", default=None, help="comma-separated backends (default: all available)")
    bench.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    bench.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is kept)")
    bench.add_argument("--json", default=None, help="also write the records to this JSON file")
    bench.add_argument(
        "--parts",
        default="op,step",
        help="op (the CPU expert op alone), step (full training step), placement (tokens/s against the GPU "
        "memory cap per expert placement), e2e (`llamafactory-cli train` per system: the product path), "
        "gen (generation through LF's do_predict: kt-ft against its adapter merged)",
    )
    bench.add_argument(
        "--e2e-systems",
        default=None,
        help="e2e part: comma-separated systems: peft, kt-cpu:<backend>, kt-auto, kt-auto@<GiB>, kt-stream, kt-peer "
        "(default: all but kt-peer, with backends torch and kt-kernel, caps 12 and 24)",
    )
    bench.add_argument(
        "--workdir", default="bench-e2e", help="e2e part: model, data, recipes and logs go here"
    )
    bench.add_argument(
        "--e2e-steps", type=int, default=5, help="e2e part: optimizer steps per run (max_steps)"
    )
    bench.add_argument(
        "--e2e-rounds",
        type=int,
        default=1,
        help="e2e part: passes over the systems, each in the reverse order of the one before; the table "
        "pairs each run with the peft run of its round and ends with each system's median",
    )
    bench.add_argument(
        "--cpu-infer",
        type=int,
        default=None,
        help="e2e part: the recipes' cpu_infer (default: kt-ft's default)",
    )
    bench.add_argument("--grad-accum", type=int, default=4, help="e2e part: gradient_accumulation_steps")
    bench.add_argument(
        "--e2e-lengths",
        choices=("cutoff", "varied"),
        default="cutoff",
        help="e2e part: every example longer than --seq (each micro-batch exactly --seq tokens), or varied "
        "lengths from about a quarter of --seq up (SFT data without packing)",
    )
    bench.add_argument(
        "--peer-site",
        default=None,
        help="e2e part: a directory with transformers-kt, accelerate-kt and kt-kernel installed "
        "(pip install --no-deps --target DIR): KTransformers' own SFT path as system kt-peer",
    )
    bench.add_argument(
        "--run-timeout", type=float, default=900, help="e2e part: seconds before a run is killed"
    )
    bench.add_argument(
        "--gen-system",
        default="kt-cpu:torch",
        help="gen part: the kt-ft system (kt-cpu:<backend>, kt-auto, ...)",
    )
    bench.add_argument("--gen-samples", type=int, default=16, help="gen part: prompts")
    bench.add_argument("--gen-batch", type=int, default=8, help="gen part: per_device_eval_batch_size")
    bench.add_argument("--gen-prompt", type=int, default=256, help="gen part: prompt tokens")
    bench.add_argument("--gen-new-tokens", type=int, default=64, help="gen part: max_new_tokens (greedy)")
    bench.add_argument(
        "--gen-merged-dir",
        default=None,
        help="gen part: where the merged model is written (default: under --workdir; a full-size model "
        "and its merged copy may not fit one disk)",
    )
    bench.add_argument(
        "--systems",
        default="kt-ft,kt-ft-stream,kt-ft-auto,peft-gpu,offload",
        help="full-step systems: kt-ft (each CPU backend), kt-ft-stream (every expert streamed to the GPU), "
        "kt-ft-auto (placement: auto under --gpu-cap, the offload run's cap), peft-gpu, offload",
    )
    bench.add_argument(
        "--layers", default=None, help="decoder layers in the full step, comma-separated counts (default 4)"
    )
    bench.add_argument("--seq", type=int, default=2048, help="tokens per full training step")
    bench.add_argument(
        "--placements",
        default="cpu,auto,stream",
        help="placement part: kt-ft placements to run, comma-separated: cpu (every expert on the CPU, "
        "plus kt-kernel's where it runs), auto (at each cap), stream (every expert streamed)",
    )
    bench.add_argument(
        "--caps",
        default=",".join(f"{c:g}" for c in (8, 16, 24, 40, 80)),
        help="placement part: GPU memory caps in GiB for the full model, comma-separated",
    )
    bench.add_argument(
        "--plot", default=None, help="placement part: draw tokens/s against the cap into this PNG"
    )
    bench.add_argument("--steps", type=int, default=3, help="timed full steps (after one warm-up; best kept)")
    bench.add_argument(
        "--gpu-cap", type=float, default=24.0, help="offload's GPU memory cap in GiB, for the full model"
    )
    bench.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="step and placement parts: one more training step of each system under torch.profiler (not "
        "part of the figures), its op tables by CPU and device time to DIR/<system>.txt (the e2e part's "
        "runs: KT_FT_PROFILE)",
    )
    bench.add_argument(
        "--trace",
        action="store_true",
        help="with --profile: each profiled step's timeline too (DIR/<system>.trace.json, for Perfetto or "
        "chrome://tracing)",
    )
    bench.add_argument(
        "--no-replan",
        dest="replan",
        action="store_false",
        help="step and placement parts: time placement auto's first split as the planner made it (no "
        "calibration of the CPU rate in the run, no trial of another split)",
    )
    bench.set_defaults(func=_bench)

    sets = sub.add_parser("settings", help="every KT_FT_* environment switch: default, what it changes")
    sets.set_defaults(func=_settings)

    conv = sub.add_parser(
        "convert", help="write a kt-ft adapter as a per-expert PEFT adapter (vLLM, SGLang, PEFT)"
    )
    conv.add_argument("dir", help="kt-ft adapter dir (an output dir or a checkpoint-N)")
    conv.add_argument("out", help="output directory")
    conv.add_argument(
        "--split", action="store_true", help="write OUT/experts and OUT/non_experts instead of one adapter"
    )
    conv.set_defaults(func=_convert)

    merge = sub.add_parser(
        "merge", help="fold a kt-ft adapter into the base weights (plain transformers model)"
    )
    merge.add_argument("dir", help="kt-ft adapter dir (an output dir or a checkpoint-N)")
    merge.add_argument("out", help="output directory for the merged model")
    merge.add_argument(
        "--base", default=None, help="local base model dir (default: the manifest's base_model.name_or_path)"
    )
    merge.set_defaults(func=_merge)

    quant = sub.add_parser(
        "quantize",
        help="write a bf16 checkpoint with quantized weights (fp8 blocks, int4 groups, int8 channels, mxfp4)",
    )
    quant.add_argument("model", help="local model dir (bf16/fp16/fp32 safetensors)")
    quant.add_argument(
        "out", help="output directory (must not exist; written to a temporary dir, then renamed)"
    )
    quant.add_argument(
        "--format",
        required=True,
        choices=["int8", "fp8", "int4", "mxfp4"],
        help="fp8: every projection, 128x128-block scales (DeepSeek-V3's layout); int4: routed experts, "
        "group 32 (compressed-tensors pack-quantized, Kimi K2's); int8: routed experts, per channel; "
        "mxfp4: gpt_oss's routed experts, fp4 with a power-of-two scale per 32 (gpt-oss's hub layout)",
    )
    quant.set_defaults(func=_quantize)
    dequant = sub.add_parser(
        "dequantize", help="write a quantized checkpoint (fp8, int4, int8, mxfp4) back in bf16"
    )
    dequant.add_argument("model", help="local quantized model dir")
    dequant.add_argument("out", help="output directory (must not exist)")
    dequant.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="output dtype")
    dequant.set_defaults(func=_dequantize)

    rules = sub.add_parser("rules", help="optimize rules").add_subparsers(dest="rules_command", required=True)
    rl = rules.add_parser("list", help="list built-in rules")
    rl.set_defaults(func=_rules_list)
    rc = rules.add_parser("check", help="validate a rule file (or built-in rule name)")
    rc.add_argument("file")
    rc.add_argument(
        "--model", default=None, help="model dir: also match the rules against its modules (meta)"
    )
    rc.set_defaults(func=_rules_check)
    rp = rules.add_parser(
        "plan", help="where every module goes and the memory it takes, from config.json alone (no weights)"
    )
    rp.add_argument("--rule", required=True, help="rule file or built-in rule name")
    rp.add_argument("--model", required=True, help="model dir (config.json; safetensors headers for dtype)")
    rp.add_argument("--gpu-mem", type=float, default=None, help="GPU memory budget per GPU, GiB")
    rp.add_argument("--cpu-mem", type=float, default=None, help="CPU RAM budget, GiB")
    rp.add_argument("--cutoff-len", type=int, default=2048, help="tokens per sequence (recipe cutoff_len)")
    rp.add_argument("--batch", type=int, default=1, help="sequences per step (per_device_train_batch_size)")
    rp.add_argument("--lora-rank", type=int, default=8, help="lora_rank")
    rp.add_argument(
        "--pure-bf16",
        action="store_true",
        help="LLaMA-Factory's pure_bf16: LoRA, its grads and AdamW moments in bf16 (8 bytes a trainable "
        "parameter instead of 16)",
    )
    rp.add_argument(
        "--cpu-infer", type=int, default=None, help="CPU threads (default: physical cores minus a few)"
    )
    rp.add_argument("--kt-backend", default="auto", help="the recipe's kt_backend")
    rp.add_argument(
        "--rates",
        default=None,
        help="machine rates for the placement cost model instead of the cached/measured ones, e.g. "
        "cpu_token_us=90,link_gbps=55,gpu_tflops=400 (keys: cpu_token_us, cpu_pair_us, cpu_tflops, link_gbps, "
        "gpu_tflops, gpu_expert_tflops); also prints the prediction for a manual placement",
    )
    rp.add_argument(
        "--remeasure", action="store_true", help="measure this machine's rates again (cache refreshed)"
    )
    rp.add_argument("--json", action="store_true", help="print the numbers as JSON")
    rp.set_defaults(func=_rules_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kt_ft.base.log import get_logger  # why: lazy CLI
    from kt_ft.base.settings import log_changed  # why: lazy CLI

    log_changed(get_logger("kt_ft.integrations.cli.main"))
    if getattr(args, "command", None) == "bench" and args.threads is None:
        from kt_ft.plan.recipe import physical_cpu_cores  # why: lazy CLI

        args.threads = physical_cpu_cores()
    try:
        return args.func(args)
    except KTConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
