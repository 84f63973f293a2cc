"""CPU seconds the `berth` command costs before it does anything: each command below run
N times as a subprocess (as a user or the test suite runs it), the least user+system CPU
time of the N printed (the least is the one least disturbed by other load on the machine).

    .venv/bin/python bench/cli_startup.py [--runs 7]

`jobs --json` asks a port where nothing listens, so it measures startup and a refused
connection, not the dashboard. With --modules, also the CPU time of importing each
service's module (what a service process pays before it starts)."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

COMMANDS = {
    "--version": ["--version"],
    "--help": ["--help"],
    "submit --help": ["submit", "--help"],
    "jobs --json (nothing listening)": ["jobs", "--json", "--api-url", "http://127.0.0.1:9"],
}
SERVICES = ("scheduler", "submitter", "dashboard_api", "worker_agent")


def cpu_of(argv: list[str]) -> float:
    """User + system CPU seconds of one run of `argv`, from this process's child rusage."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                   env={**os.environ, "BERTH_API_URL": ""})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def least(argv: list[str], runs: int) -> float:
    return min(cpu_of(argv) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--modules", action="store_true",
                        help="also each service module's import")
    args = parser.parse_args()
    print(f"python -c pass: {least([sys.executable, '-c', 'pass'], args.runs):.2f} CPU-s")
    for label, rest in COMMANDS.items():
        cpu = least([sys.executable, "-m", "berth.cli", *rest], args.runs)
        print(f"berth {label}: {cpu:.2f} CPU-s")
    for service in SERVICES if args.modules else ():
        cpu = least([sys.executable, "-c", f"import services.{service}.service"], args.runs)
        print(f"import services.{service}.service: {cpu:.2f} CPU-s")
    print(f"(least of {args.runs} runs; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
