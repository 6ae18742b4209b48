"""Load an optimize-rule file, keeping the file:line of every value for error messages.

Format (a YAML list; the first rule whose ``match`` holds wins)::

    - match:
        class: Qwen3MoeExperts          # class name or dotted path; subclasses match
        name: "layers\\.\\d+\\.mlp\\.experts$"   # Python regex, searched on the dotted module name
      replace:                          # (or `place`) where and how the matched module runs
        device: cpu                     # cpu | cuda | cuda:N
        backend: auto                   # experts only: auto | torch | reference | kt-kernel
        threads: 16                     # experts only: CPU threads (default: the recipe's cpu_infer)
      recursive: true                   # false: submodules take this rule without further matching
    - default:
        device: cuda                    # device of every module no rule matches

Every problem is collected and raised at once as a KTConfigError.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import KTConfigError
from ..hparams import KT_BACKENDS

RULE_KEYS = ("match", "replace", "place", "recursive")
MATCH_KEYS = ("name", "class")
ACTION_KEYS = ("device", "backend", "threads")
DEFAULT_KEYS = ("device",)
_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+)$")
DEVICE_CHOICES = "cpu, cuda, cuda:N"


@dataclass
class Rule:
    index: int
    where: str  # "file:line" of the rule
    name: re.Pattern | None
    cls: str | None
    device: str
    backend: str | None
    threads: int | None
    recursive: bool

    def matches(self, module_name: str, module: Any) -> bool:
        if self.name is not None and not self.name.search(module_name):
            return False
        if self.cls is not None:
            names = {c.__name__ for c in type(module).__mro__} | {
                f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__
            }
            if self.cls not in names:
                return False
        return True

    def describe(self) -> str:
        parts = []
        if self.cls is not None:
            parts.append(f"class={self.cls}")
        if self.name is not None:
            parts.append(f"name=/{self.name.pattern}/")
        return f"rule #{self.index + 1} ({', '.join(parts)}) at {self.where}"


@dataclass
class RuleSet:
    source: str
    rules: list[Rule]
    default_device: str
    default_where: str


def _did_you_mean(key: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{hint}; valid keys: {', '.join(valid)}"


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[str] = []
        self._constructor = yaml.constructor.SafeConstructor()

    def at(self, node: yaml.Node) -> str:
        return f"{self.source}:{node.start_mark.line + 1}"

    def problem(self, node: yaml.Node, path: str, msg: str) -> None:
        self.problems.append(f"{self.at(node)}: {path}: {msg}")

    def value(self, node: yaml.Node) -> Any:
        return self._constructor.construct_object(node, deep=True)

    def mapping(self, node: yaml.Node, path: str, valid: tuple[str, ...]) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            self.problem(
                node, path, f"expected a mapping with keys {', '.join(valid)}, got {self.value(node)!r}"
            )
            return {}
        out = {}
        for knode, vnode in node.value:
            key = self.value(knode)
            if key not in valid:
                self.problem(knode, f"{path}.{key}", f"unknown key{_did_you_mean(str(key), valid)}")
                continue
            out[key] = vnode
        return out


def _parse_device(r: _Reader, node: yaml.Node | None, path: str, parent: yaml.Node) -> str:
    if node is None:
        r.problem(parent, path, f"missing; valid choices: {DEVICE_CHOICES}")
        return "cpu"
    dev = r.value(node)
    if not isinstance(dev, str) or not _DEVICE_RE.match(dev):
        r.problem(node, path, f"{dev!r} is not a device; valid choices: {DEVICE_CHOICES}")
        return "cpu"
    return dev


def load_rules(path: str | Path) -> RuleSet:
    """Parse and validate a rule file; raise KTConfigError listing every problem."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise KTConfigError(f"{source}: cannot read optimize rule: {e.strerror}") from e
    r = _Reader(source)
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise KTConfigError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(root, yaml.SequenceNode):
        raise KTConfigError(f"{source}:1: an optimize rule file is a YAML list of rules")

    rules: list[Rule] = []
    default_device, default_where = "cuda", f"{source} (implicit default)"
    for i, item in enumerate(root.value):
        path_i = f"[{i}]"
        if isinstance(item, yaml.MappingNode) and any(r.value(k) == "default" for k, _ in item.value):
            body = r.mapping(item, path_i, ("default",))
            d = r.mapping(body["default"], f"{path_i}.default", DEFAULT_KEYS)
            default_device = _parse_device(r, d.get("device"), f"{path_i}.default.device", body["default"])
            default_where = r.at(item)
            continue
        keys = r.mapping(item, path_i, RULE_KEYS)
        if not keys:
            continue
        if "replace" in keys and "place" in keys:
            r.problem(keys["place"], f"{path_i}.place", "give either 'replace' or 'place', not both")
        mnode = keys.get("match")
        name_re, cls = None, None
        if mnode is None:
            r.problem(item, f"{path_i}.match", "missing; a rule needs match.name and/or match.class")
        else:
            m = r.mapping(mnode, f"{path_i}.match", MATCH_KEYS)
            if isinstance(mnode, yaml.MappingNode) and not mnode.value:
                r.problem(mnode, f"{path_i}.match", "empty; give name (regex) and/or class")
            if "name" in m:
                pat = r.value(m["name"])
                try:
                    name_re = re.compile(str(pat))
                except re.error as e:
                    r.problem(m["name"], f"{path_i}.match.name", f"invalid regex {pat!r}: {e}")
            if "class" in m:
                cls = r.value(m["class"])
                if not isinstance(cls, str) or not cls:
                    r.problem(
                        m["class"], f"{path_i}.match.class", f"{cls!r} is not a class name or dotted path"
                    )
                    cls = None
        anode = keys.get("replace", keys.get("place"))
        akey = "replace" if "replace" in keys else "place"
        device, backend, threads = "cpu", None, None
        if anode is None:
            r.problem(item, f"{path_i}.replace", "missing; say at least `device`")
        else:
            a = r.mapping(anode, f"{path_i}.{akey}", ACTION_KEYS)
            device = _parse_device(r, a.get("device"), f"{path_i}.{akey}.device", anode)
            if "backend" in a:
                backend = r.value(a["backend"])
                if backend not in KT_BACKENDS:
                    r.problem(
                        a["backend"],
                        f"{path_i}.{akey}.backend",
                        f"{backend!r}; valid choices: {', '.join(KT_BACKENDS)}",
                    )
            if "threads" in a:
                threads = r.value(a["threads"])
                if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                    r.problem(
                        a["threads"], f"{path_i}.{akey}.threads", f"{threads!r}; expected a positive integer"
                    )
                    threads = None
        recursive = True
        if "recursive" in keys:
            recursive = r.value(keys["recursive"])
            if not isinstance(recursive, bool):
                r.problem(keys["recursive"], f"{path_i}.recursive", f"{recursive!r}; expected true or false")
                recursive = True
        rules.append(Rule(i, r.at(item), name_re, cls, device, backend, threads, recursive))
    if r.problems:
        raise KTConfigError(r.problems)
    return RuleSet(source, rules, default_device, default_where)
