"""The ``kt-ft`` command: make-demo-model, rules (list/check), bench, convert, merge."""

from __future__ import annotations

import argparse
import sys

from .errors import KTConfigError


def _make_demo_model(args: argparse.Namespace) -> int:
    from .demo import make_demo_model

    out = make_demo_model(args.dir, family=args.family, seed=args.seed, dtype=args.dtype)
    print(f"wrote {out}/model (tiny random {args.family}) and {out}/data (dataset_info.json, kt_demo.json)")
    return 0


def _rules_list(args: argparse.Namespace) -> int:
    from .rules import builtin_rule_names, resolve_rule_path

    for name in builtin_rule_names():
        print(f"{name}\t{resolve_rule_path(name)}")
    return 0


def _rules_check(args: argparse.Namespace) -> int:
    from .rules import load_rules, resolve_rule_path

    path = resolve_rule_path(args.file)
    if path is None:
        raise KTConfigError(f"{args.file}: no such rule file or built-in rule")
    rules = load_rules(path)
    print(f"{path}: {len(rules.rules)} rules, default device {rules.default_device}: OK")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import PRESETS, run

    if args.preset not in PRESETS:
        raise KTConfigError(f"--preset {args.preset!r} is unknown; valid choices: {', '.join(PRESETS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    backends = args.backends.split(",") if args.backends else None
    run(args.preset, tokens, backends, args.threads, args.repeat, args.json)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .export import convert_adapter

    for d in convert_adapter(args.dir, args.out, split=args.split):
        print(f"wrote {d}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from .export import merge_adapter

    print(f"wrote {merge_adapter(args.dir, args.out, base=args.base)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

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

    bench = sub.add_parser(
        "bench", help="benchmark the CPU expert op (every available backend) and GEMM ceilings"
    )
    bench.add_argument("--preset", default="tiny", help="tiny | qwen3-30b-a3b | deepseek-v2-lite")
    bench.add_argument("--tokens", default="512,2048,4096", help="comma-separated token counts per call")
    bench.add_argument("--backends", default=None, help="comma-separated backends (default: all available)")
    bench.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    bench.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is kept)")
    bench.add_argument("--json", default=None, help="also write the records to this JSON file")
    bench.set_defaults(func=_bench)

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

    rules = sub.add_parser("rules", help="optimize rules").add_subparsers(dest="rules_command", required=True)
    rl = rules.add_parser("list", help="list built-in rules")
    rl.set_defaults(func=_rules_list)
    rc = rules.add_parser("check", help="validate a rule file (or built-in rule name)")
    rc.add_argument("file")
    rc.set_defaults(func=_rules_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "bench" and args.threads is None:
        from .hparams import physical_cpu_cores

        args.threads = physical_cpu_cores()
    try:
        return args.func(args)
    except KTConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
