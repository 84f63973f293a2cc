"""The `berth` command starts without what only some commands use: the suite and every user
run it many times, so an import at the top of a command module costs each of those runs."""

from __future__ import annotations

import json
import subprocess
import sys

# What `import berth.cli` (every `berth` command, `--help` included) must not pull in: the
# NATS client and asyncio (submits and other bus commands), Redis and through it
# OpenTelemetry's SDK (`berth doctor`, `berth health`, the servers), metrics, Rich (tables),
# nkeys (making or reading a key), croniter (schedules).
HEAVY = ("asyncio", "nats", "redis", "opentelemetry.sdk", "prometheus_client", "rich",
         "berth.shared.servers", "berth.shared.messages", "pydantic", "nkeys", "croniter")

_PROBE = """
import json, sys
import berth.cli
loaded = sorted(m for m in {heavy!r} if m in sys.modules)
from berth import JobSpec, submit_job
print(json.dumps({{"loaded": loaded, "facade": [JobSpec.__name__, submit_job.__name__]}}))
"""


def test_import_berth_cli_leaves_heavy_modules_out() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    probe = json.loads(out)
    assert probe["loaded"] == []
    # The lazy facade still answers `from berth import ...` once something asks.
    assert probe["facade"] == ["JobSpec", "submit_job"]
