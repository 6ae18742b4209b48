"""The registry of environment switches (kt_ft/base/settings.py): every KT_FT_* name the code reads is
registered, values parse as documented, the ones set to other than their default are logged, and
docs/settings.md documents exactly the registry."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kt_ft.base import settings

ROOT = Path(__file__).resolve().parents[1]


def test_every_switch_the_code_names_is_registered():
    """Every KT_FT_ name in kt_ft is registered, and is read through the registry (setting one in
    process, as a probe timing a mechanism on and off does, is no read)."""
    named = set()
    for path in (ROOT / "kt_ft").rglob("*.py"):
        named |= set(re.findall(r"\bKT_FT_[A-Z_]+[A-Z]\b", path.read_text()))
    assert named, "no KT_FT_ names found: the scan is broken"
    assert named <= set(settings.SETTINGS), sorted(named - set(settings.SETTINGS))
    reads = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in (ROOT / "kt_ft").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "os.environ" in line
        and "KT_FT_" in line
        and p.name != "settings.py"
        and not re.search(r"os\.environ\[[^\]]+\]\s*=(?!=)", line)
    ]
    assert not reads, f"read through kt_ft.base.settings instead: {reads}"


def test_values_defaults_and_the_log(monkeypatch, caplog):
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert settings.enabled("KT_FT_CUDA_GRAPHS") and not settings.enabled("KT_FT_DISABLE")
    assert settings.get("KT_FT_PROFILE") is None and settings.profile() is None
    for off in ("0", "false", "No", " off "):
        monkeypatch.setenv("KT_FT_CUDA_GRAPHS", off)
        assert not settings.enabled("KT_FT_CUDA_GRAPHS"), off
    monkeypatch.setenv("KT_FT_FUSIONS", "lora,norm,rope,loss")  # the default: not a change
    assert settings.changed() == {"KT_FT_CUDA_GRAPHS": " off "}
    with pytest.raises(KeyError):
        settings.get("KT_FT_NO_SUCH_SWITCH")
    monkeypatch.setattr(settings, "_logged", False)
    log = logging.getLogger("kt_ft.test_settings")
    with caplog.at_level(logging.INFO, logger=log.name):
        settings.log_changed(log)
        settings.log_changed(log)  # once a process
    lines = [r.getMessage() for r in caplog.records if "KT_FT_CUDA_GRAPHS" in r.getMessage()]
    assert lines == [
        "setting KT_FT_CUDA_GRAPHS= off  (default 1): " + settings.SETTINGS["KT_FT_CUDA_GRAPHS"].help
    ]


def test_fusions_parses_the_list_and_names_a_bad_one(monkeypatch):
    """KT_FT_FUSIONS: all four by default; a comma (or +) list picks some; none / 0 / empty: none;
    an unknown name stops with the variable, its value and the valid names."""
    monkeypatch.delenv("KT_FT_FUSIONS", raising=False)
    assert settings.fusions() == {"lora", "norm", "rope", "loss"}
    for value, want in (
        ("lora", {"lora"}),
        (" Norm , rope ", {"norm", "rope"}),
        ("rope+loss", {"rope", "loss"}),
        ("lora,norm,rope", {"lora", "norm", "rope"}),
        ("none", set()),
        ("0", set()),
        ("", set()),
    ):
        monkeypatch.setenv("KT_FT_FUSIONS", value)
        assert settings.fusions() == want, value
    monkeypatch.setenv("KT_FT_FUSIONS", "lora,flash")
    with pytest.raises(
        ValueError,
        match=r"KT_FT_FUSIONS='lora,flash': flash is not a fusion; valid: .*lora, norm, rope, loss",
    ):
        settings.fusions()


def test_profile_parses_the_directory_and_its_options(monkeypatch):
    """KT_FT_PROFILE: DIR (step 3, no trace), options after it; a bad one stops with the value."""
    monkeypatch.setenv("KT_FT_PROFILE", "/tmp/prof")
    assert settings.profile() == settings.Profile("/tmp/prof", 3, False)
    for value, want in (
        ("/tmp/p,step=5", settings.Profile("/tmp/p", 5, False)),
        ("/tmp/p,trace", settings.Profile("/tmp/p", 3, True)),
        (" /tmp/p , trace , step=1 ", settings.Profile("/tmp/p", 1, True)),
    ):
        assert settings.parse_profile(value) == want, value
        assert settings.parse_profile(want.value()) == want  # what a child process gets back
    assert settings.parse_profile("") is None and settings.parse_profile(None) is None
    for bad in ("/tmp/p,step=0", "/tmp/p,step=x", "/tmp/p,steps=2", "/tmp/p,tracing", ",trace"):
        with pytest.raises(ValueError, match=r"KT_FT_PROFILE='.*': not a profile request; valid: DIR"):
            settings.parse_profile(bad)


def test_docs_settings_is_the_registry():
    """docs/settings.md carries ``kt-ft settings``'s tables as they are, and names no KT_FT_
    variable the registry lacks: a setting added, removed, renamed or re-documented in
    kt_ft/base/settings.py without the doc (or the other way round) fails here."""
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert settings.markdown_table() in doc, "docs/settings.md: paste `kt-ft settings`'s output"
    named = set(re.findall(r"\bKT_FT_[A-Z_]+[A-Z]\b", doc))
    assert named == set(settings.SETTINGS), (
        f"in the doc only: {sorted(named - set(settings.SETTINGS))}; "
        f"in the registry only: {sorted(set(settings.SETTINGS) - named)}"
    )


def test_every_setting_says_what_it_does():
    """Each entry has a topic (its heading in the docs) and a help text for users: a sentence, not
    a bare default."""
    for s in settings.SETTINGS.values():
        assert s.topic and len(s.help.split()) >= 5, s.name
        assert s.changes in settings.CHANGES, s.name
