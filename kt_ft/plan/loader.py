"""Load an optimize-rule file, keeping the file:line of every value for error messages.

Format (a YAML list; the first rule whose ``match`` holds wins)::

    - include: qwen3_moe                # another rule file (relative path) or a built-in rule name
    - match:                            # every given key must hold:
        class: Qwen3MoeExperts          #   class name or dotted path; subclasses match
        name: "mlp\\.experts$"          #   Python regex, searched on the dotted module name
        layers: "0-11"                  #   decoder-layer index in the name: 3, "0-11", [0, 1, "4-7"]
      replace:                          # (or `place`) where and how the matched module runs
        device: cpu                     # cpu | cuda | cuda:N
        backend: auto                   # experts only: auto | torch | reference | kt-kernel
        threads: 16                     # experts only: CPU threads (default: the recipe's cpu_infer)
        gpu_experts: 4                  # experts only: experts kept on the GPU (see schema.py)
        stream: all                     # experts only: experts streamed to the GPU each step (same forms, or all)
        placement: manual               # experts only: manual (as written) | auto (kt_ft/placement decides)
      recursive: true                   # false: submodules take this rule without further matching
    - default:
        device: cuda                    # device of every module no rule matches

Included rules come after the including file's own rules (so its rules win) and its
``default`` overrides the included one. Every problem is collected and raised at once as a
KTConfigError: unknown keys (with a did-you-mean), wrong types, bad regexes, devices,
backends, include cycles, and rules an earlier rule of the same file shadows.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kt_ft.base.errors import KTConfigError
from kt_ft.plan.builtin import builtin_rule_names, resolve_rule_path
from kt_ft.plan.schema import (
    DEVICE_CHOICES,
    DEVICE_RE,
    KEYS_ACTION,
    KEYS_DEFAULT,
    KEYS_MATCH,
    KEYS_RULE,
    KT_BACKENDS,
    PLACEMENTS,
    GpuExperts,
    LayerSet,
    parse_gpu_experts,
    parse_layers,
    parse_stream,
)


@dataclass(kw_only=True)  # fourteen fields, several of one type: by name only
class Rule:
    index: int  # position in its own file's list
    where: str  # "file:line" of the rule
    name: re.Pattern | None
    cls: str | tuple[str, ...] | None  # a class name or dotted path, or a list of alternatives
    device: str
    backend: str | None
    threads: int | None
    recursive: bool
    layers: LayerSet | None = None
    gpu_experts: GpuExperts | None = None
    source: str = ""  # the file the rule is written in (included rules keep theirs)
    device_at: str = ""  # "file:line: [i].replace.device", for device errors found later
    stream: GpuExperts | None = None  # experts streamed to the training device (moe/streamed.py)
    placement: str = "manual"  # routed experts: "manual" (gpu_experts as written) or "auto"

    @property
    def classes(self) -> tuple[str, ...]:
        """The class alternatives (any of them matches); () when the rule names no class."""
        if self.cls is None:
            return ()
        return (self.cls,) if isinstance(self.cls, str) else self.cls

    def matches(self, module_name: str, module: Any) -> bool:
        if self.name is not None and not any(self.name.search(n) for n in rule_names(module_name)):
            return False
        if self.layers is not None:
            layer = _layer_of(module_name)
            if layer is None or layer not in self.layers:
                return False
        if self.cls is not None:
            # PEFT's ParamWrapper (newer PEFT wraps fused experts) is transparent to class matching
            while type(module).__name__ == "ParamWrapper" and hasattr(module, "base_layer"):
                module = module.base_layer
            names = {c.__name__ for c in type(module).__mro__} | {
                f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__
            }
            if names.isdisjoint(self.classes):
                return False
        return True

    def covers(self, other: Rule) -> bool:
        """True when every module ``other`` matches is provably matched by this rule too.

        Conservative: same regex text (not regex containment), same class string (not
        subclassing), a layer set containing the other's.
        """
        if self.name is not None and (other.name is None or other.name.pattern != self.name.pattern):
            return False
        if self.cls is not None and (other.cls is None or not set(other.classes) <= set(self.classes)):
            return False
        if self.layers is not None and (other.layers is None or not other.layers.issubset(self.layers)):
            return False
        return True

    def describe(self) -> str:
        parts = []
        if self.cls is not None:
            parts.append(f"class={'|'.join(self.classes)}")
        if self.name is not None:
            parts.append(f"name=/{self.name.pattern}/")
        if self.layers is not None:
            parts.append(f"layers={self.layers}")
        return f"rule #{self.index + 1} ({', '.join(parts)}) at {self.where}"


@dataclass
class RuleSet:
    source: str
    rules: list[Rule]
    default_device: str
    default_where: str
    includes: list[str] = field(default_factory=list)  # every file read, in include order
    default_at: str = ""  # "file:line: [i].default.device" (or the implicit default's source)


# PEFT wraps the model (`base_model.model.` before every name); vision-language composites hold
# the language model under `model.language_model.` where the text-only model has `model.`.
_PEFT_PREFIX = "base_model.model."
_VL_LANGUAGE_PREFIX = "model.language_model."


def rule_names(module_name: str) -> tuple[str, ...]:
    """The names a rule's ``name`` regex is searched in: the module's name without PEFT's prefix,
    and, for a module of a vision-language model's language model, also the name the text-only
    model gives it (``model.language_model.layers.3.mlp.experts`` -> ``model.layers.3.mlp.experts``),
    so one rule (``'^model\\.layers\\.\\d+\\.mlp\\.experts$'``) places the same experts in both,
    on the meta skeleton and inside PEFT alike."""
    name = module_name.removeprefix(_PEFT_PREFIX)
    if name.startswith(_VL_LANGUAGE_PREFIX):
        return name, "model." + name.removeprefix(_VL_LANGUAGE_PREFIX)
    return (name,)


# kt_ft.plan.family.layer_index's pattern, also at the end of the name: the decoder layer itself
# (`model.layers.12`) matches `layers: 12` as well as everything inside it.
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _layer_of(module_name: str) -> int | None:
    m = _LAYER_RE.search(module_name)
    return int(m.group(1)) if m else None


def _did_you_mean(key: str, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{hint}; valid keys: {', '.join(valid)}"


class _Recorded(Exception):
    """A problem the reader has recorded that leaves the current rule item without a value."""


class _Reader:
    """Turns YAML nodes into values, recording problems as 'file:line: key.path: message'."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        self._constructor = yaml.constructor.SafeConstructor()

    def at(self, node: yaml.Node) -> str:
        return f"{self.source}:{node.start_mark.line + 1}"

    def problem(self, node: yaml.Node, path: str, msg: str) -> None:
        self.problems.append(f"{self.at(node)}: {path}: {msg}")

    def value(self, node: yaml.Node) -> Any:
        """The plain value of ``node``; a tag YAML's safe loader does not know (``!!python/object``,
        ...) and a key given twice in a mapping inside it are problems (file:line), never a
        traceback or a silent last-wins: recorded, then ``_Recorded`` ends the rule item."""
        if self._duplicates(node):
            raise _Recorded
        try:
            return self._constructor.construct_object(node, deep=True)
        except yaml.YAMLError as e:
            what = getattr(e, "problem", None) or str(e)
            self.problem(node, f"tag {node.tag}", f"not a plain YAML value ({what}); write the value itself")
            raise _Recorded from None

    def _duplicates(self, node: yaml.Node) -> bool:
        """Record every key given twice in a mapping at or below ``node``; True when there was one."""
        found = False
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for knode, vnode in node.value:
                key = knode.value if isinstance(knode, yaml.ScalarNode) else id(knode)
                if key in seen:
                    self.problem(
                        knode,
                        f"key {key!r}",
                        f"given twice in one mapping (first at line {seen[key].start_mark.line + 1})",
                    )
                    found = True
                seen.setdefault(key, knode)
                found |= self._duplicates(vnode)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                found |= self._duplicates(item)
        return found

    def mapping(self, node: yaml.Node, path: str, valid: tuple[str, ...]) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            self.problem(
                node, path, f"expected a mapping with keys {', '.join(valid)}, got {self.value(node)!r}"
            )
            return {}
        out: dict[str, yaml.Node] = {}
        for knode, vnode in node.value:
            key = self.value(knode)
            if key in out:
                self.problem(
                    knode,
                    f"{path}.{key}",
                    f"given twice in one mapping (first at line {out[key].start_mark.line + 1}); keep one",
                )
                continue
            if key not in valid:
                self.problem(knode, f"{path}.{key}", f"unknown key{_did_you_mean(str(key), valid)}")
                continue
            out[key] = vnode
        return out

    def device(self, node: yaml.Node | None, path: str, parent: yaml.Node) -> str:
        if node is None:
            self.problem(parent, path, f"missing; valid choices: {DEVICE_CHOICES}")
            return "cpu"
        dev = self.value(node)
        if not isinstance(dev, str) or not DEVICE_RE.match(dev):
            self.problem(node, path, f"{dev!r} is not a device; valid choices: {DEVICE_CHOICES}")
            return "cpu"
        return dev

    def choice(self, node: yaml.Node, path: str, choices: tuple[str, ...], default: Any) -> Any:
        """The node's value if it is one of ``choices``, else a problem listing them (``default``)."""
        got = self.value(node)
        if got not in choices:
            self.problem(node, path, f"{got!r}; valid choices: {', '.join(choices)}")
            return default
        return got

    def parsed(self, node: yaml.Node, path: str, parse) -> Any:
        """``parse(value)``; a ValueError becomes a problem at the node (result None)."""
        try:
            return parse(self.value(node))
        except ValueError as e:
            self.problem(node, path, str(e))
            return None


def _rule(r: _Reader, i: int, item: yaml.Node) -> Rule | None:
    path_i = f"[{i}]"
    keys = r.mapping(item, path_i, KEYS_RULE)
    if not keys:
        return None
    if "replace" in keys and "place" in keys:
        r.problem(keys["place"], f"{path_i}.place", "give either 'replace' or 'place', not both")
    name_re, cls, layers = None, None, None
    mnode = keys.get("match")
    if mnode is None:
        r.problem(
            item, f"{path_i}.match", "missing; a rule needs match.name, match.class and/or match.layers"
        )
    else:
        m = r.mapping(mnode, f"{path_i}.match", KEYS_MATCH)
        if isinstance(mnode, yaml.MappingNode) and not mnode.value:
            r.problem(mnode, f"{path_i}.match", "empty; give name (regex), class and/or layers")
        if "name" in m:
            pat = r.value(m["name"])
            try:
                name_re = re.compile(str(pat))
            except re.error as e:
                r.problem(m["name"], f"{path_i}.match.name", f"invalid regex {pat!r}: {e}")
        if "class" in m:
            cls = r.value(m["class"])
            if isinstance(cls, list) and cls and all(isinstance(c, str) and c for c in cls):
                cls = tuple(cls)  # alternatives, e.g. a class renamed between transformers versions
            elif not isinstance(cls, str) or not cls:
                r.problem(
                    m["class"],
                    f"{path_i}.match.class",
                    f"{cls!r} is not a class name or dotted path (or a list of them)",
                )
                cls = None
        if "layers" in m:
            layers = r.parsed(m["layers"], f"{path_i}.match.layers", parse_layers)

    akey = "replace" if "replace" in keys else "place"
    anode = keys.get(akey)
    device, backend, threads, gpu_experts, stream, placement = "cpu", None, None, None, None, "manual"
    device_at = f"{r.at(item)}: {path_i}.{akey}.device"
    if anode is None:
        r.problem(item, f"{path_i}.replace", "missing; say at least `device`")
    else:
        a = r.mapping(anode, f"{path_i}.{akey}", KEYS_ACTION)
        device = r.device(a.get("device"), f"{path_i}.{akey}.device", anode)
        if "device" in a:
            device_at = f"{r.at(a['device'])}: {path_i}.{akey}.device"
        if "backend" in a:
            backend = r.choice(a["backend"], f"{path_i}.{akey}.backend", KT_BACKENDS, None)
        if "threads" in a:
            threads = r.value(a["threads"])
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                r.problem(
                    a["threads"], f"{path_i}.{akey}.threads", f"{threads!r}; expected a positive integer"
                )
                threads = None
        if "gpu_experts" in a:
            gpu_experts = r.parsed(a["gpu_experts"], f"{path_i}.{akey}.gpu_experts", parse_gpu_experts)
        if "stream" in a:
            stream = r.parsed(a["stream"], f"{path_i}.{akey}.stream", parse_stream)
        if "placement" in a:
            placement = r.choice(a["placement"], f"{path_i}.{akey}.placement", PLACEMENTS, "manual")
            if placement == "auto":
                written = [k for k in ("gpu_experts", "stream") if k in a]
                for k in written:
                    r.problem(
                        a[k],
                        f"{path_i}.{akey}.{k}",
                        f"given with placement: auto (at line {a['placement'].start_mark.line + 1}), which "
                        f"chooses {k} itself; remove one of them",
                    )
    recursive = True
    if "recursive" in keys:
        recursive = r.value(keys["recursive"])
        if not isinstance(recursive, bool):
            r.problem(keys["recursive"], f"{path_i}.recursive", f"{recursive!r}; expected true or false")
            recursive = True
    return Rule(
        index=i,
        where=r.at(item),
        name=name_re,
        cls=cls,
        device=device,
        backend=backend,
        threads=threads,
        recursive=recursive,
        layers=layers,
        gpu_experts=gpu_experts,
        source=r.source,
        device_at=device_at,
        stream=stream,
        placement=placement,
    )


def _include_target(r: _Reader, node: yaml.Node, path: str, here: Path) -> Path | None:
    name = r.value(node)
    if not isinstance(name, str) or not name:
        r.problem(node, path, f"{name!r}; expected a rule file path or a built-in rule name")
        return None
    rel = Path(os.path.normpath(here.parent / Path(name).expanduser()))
    if rel.is_file():  # relative to the including file first, then a built-in name
        return rel
    found = resolve_rule_path(name) if not Path(name).is_absolute() else None
    if found is None or not found.is_file():
        r.problem(
            node,
            path,
            f"{name!r}: no file {rel} and no built-in rule of that name; built-in rules: "
            f"{', '.join(builtin_rule_names())}",
        )
        return None
    return found


def _shadowed(rules: list[Rule]) -> list[str]:
    """Rules of one file that can never match because an earlier rule of the file covers them."""
    out = []
    for j, later in enumerate(rules):
        for earlier in rules[:j]:
            if earlier.covers(later):
                out.append(
                    f"{later.where}: {later.describe()} can never match: the earlier {earlier.describe()} "
                    "matches every module it matches (first match wins); remove it or move it up"
                )
                break
    return out


def _load(path: Path, problems: list[str], chain: tuple[Path, ...], files: list[str]) -> RuleSet:
    source = str(path)
    files.append(source)
    try:
        text = path.read_text()
    except OSError as e:
        problems.append(f"{source}: cannot read optimize rule: {e.strerror}")
        return _empty(source)
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        problems.append(f"{source}: not valid YAML: {e}")
        return _empty(source)
    if not isinstance(root, yaml.SequenceNode):
        problems.append(f"{source}:1: an optimize rule file is a YAML list of rules")
        return _empty(source)

    r = _Reader(source, problems)
    rules: list[Rule] = []
    clean: list[Rule] = []  # rules without problems, candidates for the shadowing check
    default: tuple[str, str, str] | None = None  # device, where, key path
    included: list[RuleSet] = []
    for i, item in enumerate(root.value):
        try:
            path_i = f"[{i}]"
            first_key = (
                r.value(item.value[0][0])
                if isinstance(item, yaml.MappingNode) and len(item.value) == 1
                else None
            )
            if first_key == "default":
                d = r.mapping(item.value[0][1], f"{path_i}.default", KEYS_DEFAULT)
                dnode = d.get("device", item)
                default = (
                    r.device(d.get("device"), f"{path_i}.default.device", item.value[0][1]),
                    r.at(item),
                    f"{r.at(dnode)}: {path_i}.default.device",
                )
            elif first_key == "include":
                target = _include_target(r, item.value[0][1], f"{path_i}.include", path)
                if target is None:
                    continue
                if target.resolve() in chain:
                    cycle = " -> ".join(str(p) for p in (*chain, target.resolve()))
                    r.problem(item, f"{path_i}.include", f"include cycle: {cycle}")
                    continue
                included.append(_load(target, problems, (*chain, target.resolve()), files))
            else:
                before = len(problems)
                rule = _rule(r, i, item)
                if rule is not None:
                    rules.append(rule)
                    if len(problems) == before:
                        clean.append(rule)
        except _Recorded:  # a value the reader already reported: the rest of this item is moot
            continue
    # only rules that parsed cleanly: a rule whose bad `match` was dropped would look unconditional
    problems.extend(_shadowed(clean))

    # Own rules first (they win), then each included file's rules in include order.
    all_rules = rules + [rule for inc in included for rule in inc.rules]
    if default is None:  # the last included file that says a default, else cuda
        inherited = next((inc for inc in reversed(included) if "implicit" not in inc.default_where), None)
        if inherited is not None:
            default = (inherited.default_device, inherited.default_where, inherited.default_at)
        else:
            default = ("cuda", f"{source} (implicit default)", f"{source}: (implicit default device)")
    return RuleSet(source, all_rules, default[0], default[1], default_at=default[2])


def _empty(source: str) -> RuleSet:
    return RuleSet(
        source, [], "cuda", f"{source} (implicit default)", default_at=f"{source}: (implicit default)"
    )


def missing_devices(rules: RuleSet, cuda_count: int) -> list[str]:
    """Devices the rules name that this machine lacks. `cuda` / `cuda:0` without CUDA fall back to
    cpu (not a problem); an explicit `cuda:N` beyond the machine's GPUs is."""
    valid = ", ".join(["cpu", "cuda"] + [f"cuda:{i}" for i in range(cuda_count)])
    out = []
    for at, device in [(rule.device_at, rule.device) for rule in rules.rules] + [
        (rules.default_at, rules.default_device)
    ]:
        if not device.startswith("cuda:"):
            continue
        idx = int(device.split(":")[1])
        if idx >= max(cuda_count, 1):
            have = f"{cuda_count} CUDA device(s)" if cuda_count else "no CUDA device"
            out.append(f"{at}: {device!r} does not exist: this machine has {have}; valid choices: {valid}")
    return out


def load_rules(path: str | Path, cuda_count: int | None = None) -> RuleSet:
    """Parse and validate a rule file and its includes; raise KTConfigError listing every problem.

    With ``cuda_count`` (this machine's GPUs) a `cuda:N` the machine lacks is one of the problems.
    """
    path = Path(path)
    problems: list[str] = []
    files: list[str] = []
    rules = _load(path, problems, (path.resolve(),), files)
    if cuda_count is not None:
        problems += missing_devices(rules, cuda_count)
    if problems:
        raise KTConfigError(problems)
    rules.includes = files[1:]
    return rules
