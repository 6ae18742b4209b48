"""`kt-ft bench --parts e2e`: what a finished run's logs say.

LLaMA-Factory's ``trainer_log.jsonl`` gives the rate (elapsed time of a line = ``total_tokens /
throughput``) and the losses; the run's own log gives kt-ft's lines: the cost model's predicted
step, the CPU op's busy time, the host time a step (``KT_FT_RUN_REPORT``), what was streamed and at
which link rate (``link_bound``), and a failed run's last error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kt_ft.integrations.trainer.host_time import LINE_PREFIX as HOST_LINE


def read_trainer_log(path: Path) -> list[dict]:
    """LLaMA-Factory's trainer_log.jsonl lines of training steps (a loss) that carry tokens
    (``include_num_input_tokens_seen``); the summary line at the end of training has no loss."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r and "total_tokens" in r and r.get("throughput")]


def rate_from_log(
    rows: list[dict], skip_step: int | None = None
) -> tuple[float | None, list[float], float | None]:
    """(tokens/s over the logged steps after the first, seconds of each of those steps, tokens per
    step). Elapsed time at a log line = total_tokens / throughput (LF's own figures).
    ``skip_step``: an optimizer step (1-based) left out of the rate (the profiled one)."""
    if len(rows) < 2:
        return None, [], None
    t = [r["total_tokens"] / r["throughput"] for r in rows]
    tok = [r["total_tokens"] for r in rows]
    steps = [b - a for a, b in zip(t, t[1:])]
    pairs = [
        (tok[i + 1] - tok[i], steps[i])
        for i in range(len(steps))
        if rows[i + 1].get("current_steps") != skip_step
    ]
    secs = sum(s for _, s in pairs)
    rate = sum(n for n, _ in pairs) / secs if pairs and secs > 0 else None
    per_step = (tok[-1] - tok[0]) / (len(rows) - 1)
    return rate, steps, per_step


def last_half_rate(rows: list[dict], skip_step: int | None = None) -> float | None:
    """Tokens/s over the last half (rounded up) of the logged steps after the first, ``skip_step``
    left out (as ``rate_from_log``)."""
    half = len(rows) - 1 - (len(rows) - 1) // 2
    return rate_from_log(rows[-half - 1 :], skip_step)[0] if half > 0 else None


_PREDICTED = re.compile(r"predicted step ([0-9.]+) ms")
_CPU_OP = re.compile(r"CPU op busy ([0-9.]+) s in")
_STREAMED = re.compile(r"run summary: streamed ([0-9.]+) (GiB|MiB) in")
_LINK = re.compile(r"\blink ([0-9.]+) GB/s")
_HOST = re.compile(
    rf"({re.escape(HOST_LINE)} .*?: wall ([0-9]+) ms; CPU busy: main thread ([0-9]+) ms.*)$", re.M
)


def link_bound(text: str, steps: int, tokens_per_step: float | None) -> float | None:
    """The tokens/s a run that streamed experts cannot beat: its bytes streamed a step (the run
    summary's total over its ``steps`` optimizer steps) at the host -> GPU rate it planned with (the
    log's ``link ... GB/s``), every other cost hidden under the copies. None where nothing streamed."""
    streamed, link = _STREAMED.findall(text), _LINK.findall(text)
    if not streamed or not link or not steps or not tokens_per_step:
        return None
    value, unit = streamed[-1]
    per_step = float(value) * (2**30 if unit == "GiB" else 2**20) / steps
    if per_step <= 0:
        return None
    return tokens_per_step / (per_step / (float(link[-1]) * 1e9))


def failure_note(text: str) -> str:
    """The last error line of a failed run's log."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|error:|Killed|Traceback)", ln)]
    return (errs[-1] if errs else (lines[-1] if lines else "no output"))[:300]
