"""The quick forms of the multi-host scenarios (tests/bed_scenarios.py) on the test bed: a gang
over four hosts reaching its coordinator, named ports on an address two workers share, a
worker's slow link; one NATS node of three cut off during a burst of submits. NATS speaks TLS
only there, routes included (each checks that a plain-text peer is refused). Each starts a
fresh bed and cluster and must count 0 everywhere. bench/partitions.py runs the full forms."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import bed_scenarios, netbed

pytestmark = pytest.mark.netbed


@pytest.mark.parametrize("name", bed_scenarios.QUICK)
async def test_bed_scenario_counts_nothing_bad(name: str, tmp_path: Path) -> None:
    if why := netbed.unavailable():
        pytest.skip(why)
    result = await bed_scenarios.run_scenario(
        name, tmp_path / "berth", bed_scenarios.scenarios(quick=True)[name])
    assert not result.violations(), f"{result.scenario}: {bed_scenarios.summary(result)}"
    notes = result.notes
    # The scenario did exercise what it claims.
    if name == "hosts":
        assert notes["gang_state"] == "succeeded"
        assert notes["gang_hosts"] == ["g1", "g2", "g3", "g4"]
        assert notes["pair_workers"] == ["g1a", "g1b"], "the port holders did not share g1"
        assert notes["anonymous_refused"] is True, "valkey let a client in without a password"
        assert notes["nats_plain_refused"] is True, "NATS let a client in without TLS"
    else:
        assert result.acked >= 10, "too few submits acknowledged to call it a burst"
        assert notes["minority_tries"] >= 5
        assert notes["acked_sent_in_cut"] >= 1, "the burst was over before the cut"
        assert notes["routes_tls"] is True, "a NATS route port did not ask for TLS"
    assert not netbed.our_namespaces(os.getpid()), "the bed left namespaces behind"
