"""Every partition scenario on the test bed of network namespaces (tests/netbed.py), each on
a fresh cluster, and a table of what each counted. Needs root, `ip` and `nft`.

    sudo .venv/bin/python bench/partitions.py [--cut 12] [--quick] [scenario ...]

The scenarios: a worker (whose tasks end on their own during the cut: before its fence,
after it, after the verdict), the leader, or Redis for both schedulers cut off
(tests/partitions.py); one NATS node of three cut off during a submit burst, the Redis
primary cut off from its replicas and Sentinels, or from everyone, while Sentinel promotes a
replica, a gang over four hosts with named ports on a shared address, a worker's NATS link
delayed, a worker's NATS link or the leader's NATS and Redis links losing 15% of their
packets each way (tests/bed_scenarios.py). NATS speaks TLS only, routes included.
`--quick`: the sizes the tests use (fewer submits and port holders, the NATS cut at most
4 s, the loss at most 6 s).

Columns: acknowledged submits, lost, jobs not terminal, double-booked hosts (the checker,
during and after), tasks seen with two live attempts (sampled from /proc every 0.1 s) and
the longest overlap, stale commands obeyed, healthy workers declared dead, NATS writes
acknowledged without quorum, epochs gone back, reservations lost, port collisions, gang
members that missed their coordinator, tasks due to end after their fence that completed
twice, tasks shown succeeded twice (or a written-off attempt shown succeeded), services that
died; then what was measured (seconds from the cut): when the cut-off worker's old copies
were gone and when their first retry started, when the standby took over and when a job
submitted during the cut was placed, the cut-off worker's reports that arrived after the
heal, and tasks that ended before their fence and ran again; for the lossy links, the
longest the NATS server went without a worker's heartbeat, how many attempts fenced
themselves, and the take-overs. Every count must read 0; the exit code says whether one did
not, and the logs of a scenario that counted anything are kept, with the schedulers' last
lines and the workers' refusals printed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import bed_scenarios, netbed, partitions

COLUMNS = ("acked", *(c for c in partitions.COUNTS if c != "two_copies"), "two_copies",
           "two_copies_s")
MEASURED = ("old_copies_gone_s", "first_retry_s", "rejoined_after_heal_s", "cut_s",
            "take_over_s", "take_over_after_heal_s", "probe_placed_s", "placed_during_cut_s",
            "all_placed_after_heal_s", "late_reports", "reran_after_ending",
            "longest_heartbeat_gap_s", "fenced", "take_overs", "resets", "retries")
# Lines of each scheduler's log printed when a scenario counted anything.
LOG_TAIL = 15


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cut", type=float, default=12.0, help="seconds each cut lasts")
    parser.add_argument("--quick", action="store_true",
                        help="the tests' sizes (fewer submits, NATS cut at most 4 s)")
    parser.add_argument("names", nargs="*", help="scenarios (default: all): "
                        + ", ".join([*partitions.scenarios(), *bed_scenarios.scenarios()]))
    args = parser.parse_args()
    if why := netbed.unavailable():
        print(f"skipped: {why}")
        return 0
    table = partitions.scenarios(args.cut)
    more = bed_scenarios.scenarios(args.cut, quick=args.quick)
    names = args.names or [*table, *more]
    if unknown := [n for n in names if n not in table and n not in more]:
        parser.error(f"unknown scenario {unknown[0]!r}")
    results = []
    with tempfile.TemporaryDirectory(prefix="berth-partitions-") as tmp:
        for name in names:
            started = time.monotonic()
            data_dir = Path(tmp) / name
            result = asyncio.run(
                partitions.run_scenario(name, data_dir, table[name]) if name in table
                else bed_scenarios.run_scenario(name, data_dir, more[name]))
            result.notes["wall_s"] = round(time.monotonic() - started)
            results.append(result)
            print(f"{result.scenario}: {result.violations() or 'all 0'} {result.notes}",
                  file=sys.stderr, flush=True)
            if result.violations():
                # The services' and servers' logs are what tells why: kept past the run.
                kept = Path(tempfile.mkdtemp(prefix=f"berth-partitions-{name}-"))
                shutil.copytree(data_dir / "logs", kept / "logs", dirs_exist_ok=True)
                print(f"  logs kept in {kept}/logs", file=sys.stderr, flush=True)
                _tell(kept / "logs")
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


def _tell(logs: Path) -> None:
    """What the logs say first about a failed run: each scheduler's last lines (whether it
    leads, and what it last did), and what each worker refused or reset."""
    for path in sorted(logs.glob("scheduler-*.log")):
        lines = path.read_text(errors="replace").splitlines()
        print(f"  {path.name}, last {LOG_TAIL} lines:", file=sys.stderr)
        for line in lines[-LOG_TAIL:]:
            print(f"    {line}", file=sys.stderr)
    for path in sorted(logs.glob("w*.log")):
        text = path.read_text(errors="replace")
        print(f"  {path.name}: " + ", ".join(
            f"{text.count(what)} {what!r}" for what in
            ("refusing command of epoch", "refusing command for incarnation",
             "starting a new incarnation", "was fenced off", "dropped a message")),
            file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
