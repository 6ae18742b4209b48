"""Where built-in optimize rules live and how a recipe's ``kt_optimize_rule`` is resolved."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]
# Installed wheel: kt_ft/optimize_rules (force-included); editable/source tree: ./optimize_rules.
RULE_DIRS = (_PKG / "optimize_rules", _PKG.parent / "optimize_rules")


def builtin_rule_names() -> list[str]:
    names = set()
    for d in RULE_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def resolve_rule_path(name_or_path: str) -> Path | None:
    """A file path if it exists, else the built-in rule of that name, else None."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    for d in RULE_DIRS:
        cand = d / f"{name_or_path}.yaml"
        if cand.is_file():
            return cand
    return None
