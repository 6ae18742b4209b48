"""Draw one placement plot (tokens/s against the GPU memory cap) from several `kt-ft bench --parts
placement --json` files, e.g. a full run and a later one at other caps:

    python -m kt_ft.integrations.bench.probes.plot_placement run1.json run2.json --out docs/placement.png

Records of the same system and cap in a later file replace the earlier ones (a re-measurement).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from kt_ft.integrations.bench.models import StepRecord
from kt_ft.integrations.bench.placement import plot_placement, print_placement_table


def load(paths: list[str]) -> list[StepRecord]:
    names = {f.name for f in fields(StepRecord)}
    by_key: dict[tuple, StepRecord] = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["records"]:
                if r.get("kind") != "placement":
                    continue
                rec = StepRecord(**{k: v for k, v in r.items() if k in names})
                by_key[(rec.name, rec.cap_gib)] = rec
    return list(by_key.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="placement bench JSON files, oldest first")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    records = load(args.json)
    if not records:
        raise SystemExit(f"{', '.join(args.json)}: no placement records")
    print_placement_table(records)
    return 0 if plot_placement(records, args.out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
