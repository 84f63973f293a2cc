"""Every partition scenario on the test bed of network namespaces (tests/netbed.py), each on
a fresh cluster, and a table of what each counted. Needs root, `ip` and `nft`.

    sudo .venv/bin/python bench/partitions.py [--cut 12] [scenario ...]

Columns: acknowledged submits, lost, jobs not terminal, double-booked hosts (the checker,
during and after), tasks seen with two live attempts (sampled from /proc every 0.1 s) and
the longest overlap, stale commands obeyed, healthy workers declared dead, services that
died; then what was measured (seconds from the cut): when the cut-off worker's old copies
were gone and when their first retry started, when the standby took over and when a job
submitted during the cut was placed. Every count must read 0; the exit code says whether
one did not.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import netbed, partitions

COLUMNS = ("acked", "lost", "not_terminal", "double_booked", "two_copies", "two_copies_s",
           "stale_obeyed", "wrong_deaths")
MEASURED = ("old_copies_gone_s", "first_retry_s", "rejoined_after_heal_s", "take_over_s",
            "probe_placed_s", "resets", "retries")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cut", type=float, default=12.0, help="seconds each cut lasts")
    parser.add_argument("names", nargs="*", help="scenarios (default: all): "
                        + ", ".join(partitions.scenarios()))
    args = parser.parse_args()
    if why := netbed.unavailable():
        print(f"skipped: {why}")
        return 0
    table = partitions.scenarios(args.cut)
    names = args.names or list(table)
    results = []
    with tempfile.TemporaryDirectory(prefix="berth-partitions-") as tmp:
        for name in names:
            started = time.monotonic()
            result = asyncio.run(partitions.run_scenario(name, Path(tmp) / name, table[name]))
            result.notes["wall_s"] = round(time.monotonic() - started)
            results.append(result)
            print(f"{result.scenario}: {result.violations() or 'all 0'} {result.notes}",
                  file=sys.stderr, flush=True)
    head = ["scenario", *COLUMNS, "died", *MEASURED, "wall_s"]
    rows = [[r.scenario, *(str(getattr(r, c)) for c in COLUMNS), str(len(r.died)),
             *(str(r.notes.get(m, "-")) for m in MEASURED), str(r.notes["wall_s"])]
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    return 1 if any(r.violations() for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
