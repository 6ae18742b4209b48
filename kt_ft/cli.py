"""The ``kt-ft`` command: make-demo-model, rules (list/check)."""

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

    rules = sub.add_parser("rules", help="optimize rules").add_subparsers(dest="rules_command", required=True)
    rl = rules.add_parser("list", help="list built-in rules")
    rl.set_defaults(func=_rules_list)
    rc = rules.add_parser("check", help="validate a rule file (or built-in rule name)")
    rc.add_argument("file")
    rc.set_defaults(func=_rules_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KTConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
