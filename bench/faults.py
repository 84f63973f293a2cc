"""The fault suite's full form (tests/faults/): every scenario on a fresh stack, and a table
of what each counted. Every count must read 0; the exit code says whether one did not.

    .venv/bin/python bench/faults.py [--quick] [--fuzz N] [scenario ...]

Columns (tests/faults/harness.py says what each counts): acknowledged submits, lost, jobs
not terminal, reports lost, reports applied twice, double-booked hosts and ports (the
checker, during the run and at the end), other checker violations at the end, tasks seen
with two live copies (/proc), orphan processes after the stack stopped, jobs and workers
where the dashboard differs from a fresh fold, elections that reused an epoch, services
that died; then the retries the faults cost and the scenario's seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.faults import harness

QUICK = ["valkey-restart-empty", "leader-sigkill", "fuzz"]
QUICK_FUZZ = 3000


def table(results: list[harness.Counts]) -> str:
    head = ["scenario", *harness.COUNTS, "died", "retries", "wall_s"]
    rows = [[r.scenario, *(str(getattr(r, c)) for c in harness.COUNTS), str(len(r.died)),
             str(r.notes.get("retries", "-")), str(r.notes.get("wall_s", "-"))]
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |"
              for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)}, with a fuzz of {QUICK_FUZZ} payloads")
    parser.add_argument("--fuzz", type=int, default=None,
                        help="payloads the fuzz sends (default 100,000)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="run in this directory and keep it (the services' logs)")
    parser.add_argument("names", nargs="*", help="scenarios (default: all): "
                        + ", ".join(harness.ALL))
    args = parser.parse_args()
    names = args.names or (QUICK if args.quick else harness.ALL)
    if unknown := [n for n in names if n not in harness.ALL]:
        parser.error(f"unknown scenario {unknown[0]!r}; one of {', '.join(harness.ALL)}")
    fuzz = args.fuzz or (QUICK_FUZZ if args.quick else 100_000)
    results = []
    with tempfile.TemporaryDirectory(prefix="berth-faults-") as tmp:
        where = args.keep or Path(tmp)
        for name in names:
            started = time.monotonic()
            try:
                result = asyncio.run(harness.run_scenario(name, where / name, fuzz, args.quick))
            except Exception as exc:  # a row that says so, and the other scenarios still run
                result = harness.Counts(name, died=[f"the scenario raised {exc!r}"[:200]])
            result.notes["wall_s"] = round(time.monotonic() - started)
            results.append(result)
            print(f"{name}: {result.violations() or 'all 0'} {result.notes}",
                  file=sys.stderr, flush=True)
    print(table(results))
    return 1 if any(r.violations() for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
