"""Optimize rules: YAML that maps modules to devices and expert kernels.

recipe key -> ``builtin.resolve_rule_path`` -> ``loader.load_rules`` (RuleSet with file:line
for every value) -> ``plan.make_plan`` (which experts go where) -> ``kt_ft.moe.patch``.
"""

from .builtin import builtin_rule_names, resolve_rule_path
from .loader import Rule, RuleSet, load_rules
from .plan import PlacementPlan, make_plan

__all__ = [
    "PlacementPlan",
    "Rule",
    "RuleSet",
    "builtin_rule_names",
    "load_rules",
    "make_plan",
    "resolve_rule_path",
]
