"""Process memory as Linux accounts it (``/proc/<pid>/smaps_rollup`` and ``smaps``), for the
data-parallel memory report: is the routed-expert memory one copy per machine or one per rank?

Rss counts every resident page the process maps; Pss divides each page by the number of
processes mapping it (summed over the processes of a machine, Pss is their real total);
Private counts pages only this process maps (mapped once, even in a shared mapping).
All values are bytes.

``KT_FT_RUN_REPORT=DIR`` makes every rank of a kt-ft training write
``DIR/rank{R}.json`` at the end of training (``memory_report``), all ranks at once (between
two barriers, so each sees the others' mappings): ``kt_ft/integrations/bench/probes/ddp_memory.py``
reads them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kt_ft.backends.quant_weights import stored_nbytes
from kt_ft.base.processes import barrier
from kt_ft.base.settings import get
from kt_ft.runtime.adapter import kt_expert_modules
from kt_ft.runtime.shared_weights import FILE_PREFIX

REPORT_ENV = "KT_FT_RUN_REPORT"  # its host-time part: kt_ft/integrations/trainer/host_time.py
_ROLLUP_KEYS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def rollup(pid: int | str = "self") -> dict[str, int]:
    """Rss, Pss (and its Anon / File / Shmem parts), Private and Shared of process ``pid``."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key] = int(parts[0]) * 1024
    out = {k: fields.get(k, 0) for k in _ROLLUP_KEYS}
    out["Private"] = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    out["Shared"] = fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0)
    return out


def mappings_matching(substring: str, pid: int | str = "self") -> dict[str, int]:
    """Size, Rss, Pss and Private summed over the mappings whose path contains ``substring``
    (a deleted file keeps its path, with " (deleted)" after it)."""
    totals = {"Size": 0, "Rss": 0, "Pss": 0, "Private": 0, "count": 0}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # a mapping's header line
            inside = len(head) == 6 and substring in head[5]
            totals["count"] += inside
            continue
        if not inside:
            continue
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) != 2 or parts[1] != "kB":
            continue
        value = int(parts[0]) * 1024
        if key in ("Size", "Rss", "Pss"):
            totals[key] += value
        elif key in ("Private_Clean", "Private_Dirty"):
            totals["Private"] += value
    return totals


def memory_record(expert_bytes: int) -> dict:
    """This process's memory, its shared routed-expert mapping, and the expert bytes it uses."""
    return {
        "pid": os.getpid(),
        "rank": int(os.environ.get("RANK", 0)),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        "expert_bytes": expert_bytes,
        "process": rollup(),
        "expert_mapping": mappings_matching(FILE_PREFIX),
    }


def memory_report(model) -> Path | None:
    """With ``KT_FT_RUN_REPORT=DIR``: write this rank's ``memory_record`` to DIR/rank{R}.json,
    all ranks between two barriers. Collective (every rank calls it). None when unset."""
    directory = get(REPORT_ENV)
    if not directory:
        return None
    expert_bytes = sum(
        stored_nbytes(p) for m in kt_expert_modules(model) for p in (m.gate_up_proj, m.down_proj)
    )
    barrier()  # every rank is alive and has touched its experts
    record = memory_record(expert_bytes)
    path = Path(directory) / f"rank{record['rank']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    barrier()  # nobody exits (unmapping) before all have read their smaps
    return path
