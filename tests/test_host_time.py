"""The host-time callback (``kt_ft/integrations/trainer/host_time.py``): threads' CPU time a step."""

import os
import sys
import threading
import time

import pytest

from kt_ft.integrations.bench.e2e import _HOST
from kt_ft.integrations.trainer.host_time import (
    HostTime,
    busy_by_thread,
    summary_line,
    thread_cpu_seconds,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_seconds_sees_a_busy_thread_by_name():
    """A thread that burns 0.3 s of CPU shows 0.2-1.0 s under its own name, apart from the main thread."""
    before = thread_cpu_seconds()
    assert os.getpid() in before  # the main thread's id is the process id
    done, release = threading.Event(), threading.Event()

    def work():
        _spin(0.3)
        done.set()
        release.wait()  # alive at the second read: an ended thread leaves /proc

    t = threading.Thread(target=work)
    t.start()
    with open(f"/proc/self/task/{t.native_id}/comm", "w") as f:  # Linux's name, not Python's
        f.write("kt-busy")
    done.wait()
    busy = busy_by_thread(before, thread_cpu_seconds(), os.getpid())
    release.set()
    t.join()
    assert 0.2 <= busy["kt-busy"] <= 1.0, busy
    assert busy["main"] < 0.25, busy  # the main thread only waited


def test_busy_by_thread_counts_new_threads_from_zero_and_groups_names():
    before = {1: ("main", 1.0), 2: ("pool", 0.5)}
    after = {1: ("main", 1.4), 2: ("pool", 0.7), 3: ("pool", 0.1), 4: ("pt_autograd_0", 0.3)}
    busy = busy_by_thread(before, after, main_tid=1)
    assert busy == pytest.approx({"main": 0.4, "pool": 0.3, "pt_autograd_0": 0.3})


def test_summary_line_medians_and_the_e2e_parser_reads_it():
    steps = [
        (1.0, {"main": 0.9, "pt_autograd_0": 0.2, "a": 0.01, "b": 0.02, "c": 0.03}),
        (1.2, {"main": 1.0, "pt_autograd_0": 0.4}),
        (1.1, {"main": 0.95, "pt_autograd_0": 0.3, "a": 0.05}),
    ]
    line = summary_line(steps)
    assert (
        "median of 3 steps" in line
        and "wall 1100 ms" in line
        and "main thread 950 ms (86% of the wall)" in line
    )
    assert "pt_autograd_0 300 ms" in line  # median over the steps, 0 where a thread was idle
    assert "other threads" in line  # the fourth name and beyond, summed
    ((text, wall, main),) = _HOST.findall(f"[INFO|kt_ft] {line}\nnext line")
    assert (float(wall), float(main)) == (1100.0, 950.0) and text == line
    assert summary_line([]) is None


def test_callback_skips_the_first_and_the_profiled_step():
    class State:
        global_step = 0
        is_world_process_zero = True

    cb, st = HostTime(skip_step=3), State()
    for step in range(1, 6):
        st.global_step = step
        cb.on_step_end(None, st, None)
    # step 1 has no start to measure from; step 3 was profiled: steps 2, 4 and 5 remain
    assert len(cb.steps) == 3 and all(w >= 0 for w, _ in cb.steps)


def test_run_report_logs_and_writes_the_host_time(tmp_path, monkeypatch, caplog):
    """KT_FT_RUN_REPORT=DIR asks for the callback (skipping KT_FT_PROFILE's step); at the end of
    training the first rank logs the summary line and writes it, with every step, to
    DIR/host_time.json; another rank writes nothing. Unset: no callback."""
    import json
    import logging

    from kt_ft.integrations.trainer.host_time import host_time_from_env

    monkeypatch.delenv("KT_FT_RUN_REPORT", raising=False)
    assert host_time_from_env() is None
    monkeypatch.setenv("KT_FT_RUN_REPORT", str(tmp_path / "report"))
    monkeypatch.setenv("KT_FT_PROFILE", f"{tmp_path / 'prof'},step=2")
    cb = host_time_from_env()
    assert cb is not None and cb.skip_step == 2

    class State:
        global_step = 0
        is_world_process_zero = False

    st = State()
    for step in range(1, 5):
        st.global_step = step
        cb.on_step_end(None, st, None)
    cb.on_train_end(None, st, None)
    assert not (tmp_path / "report").exists()  # not the first rank
    st.is_world_process_zero = True
    with caplog.at_level(logging.INFO, logger="kt_ft"):
        cb.on_train_end(None, st, None)
    record = json.loads((tmp_path / "report" / "host_time.json").read_text())
    assert len(record["steps"]) == 2 and record["skipped_step"] == 2  # steps 3 and 4
    assert record["summary"] == summary_line(cb.steps)
    assert any(r.getMessage() == record["summary"] for r in caplog.records)
