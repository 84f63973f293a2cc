"""The quick form of the partition scenarios (tests/partitions.py), on the test bed: a worker
cut off from NATS both ways past the dead-after time (its tasks ending on their own during
the cut, before and after its fence), and the leader cut off from NATS. Each
starts a fresh bed and cluster and must count 0 everywhere. `pytest -m netbed` selects them;
bench/partitions.py runs every scenario and prints the table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import netbed, partitions

pytestmark = pytest.mark.netbed


@pytest.mark.parametrize("name", partitions.QUICK)
async def test_partition_scenario_counts_nothing_bad(name: str, tmp_path: Path) -> None:
    if why := netbed.unavailable():
        pytest.skip(why)
    result = await partitions.run_scenario(name, tmp_path / "berth")
    assert not result.violations(), f"{result.scenario}: {result.violations()} {result.notes}"
    # The scenario did exercise what it claims.
    if name.startswith("worker"):
        assert result.notes["victim_tasks"] >= 1 and result.notes["rejoined_after_heal_s"]
        assert result.notes["addresses_advertised"]
        assert result.notes["old_copies_gone_s"] < result.notes["first_retry_s"]
        # Its tasks ended on their own during the cut, one before its fence and one after
        # (completed_twice and applied_twice above count what became of them); the first's
        # report came from the old incarnation after the heal.
        ends = result.notes["ends_in_cut"]
        assert "before_fence" in ends and "after_fence" in ends, ends
        assert result.notes["late_reports"] >= 1, "no report from the cut arrived late"
    else:
        assert result.notes["take_over_s"] is not None, "the standby never took over"
        assert result.notes["probe_placed_s"] is not None, "nothing placed during the cut"
        # The cut lasts what it says (plus the checker's run at its end): a wait that
        # stretched it once read as a leader slow to return after the heal.
        cut_s = result.notes["cut_s"]
        assert cut_s < partitions.DEFAULT_CUT + 4, (
            f"a {partitions.DEFAULT_CUT:g} s cut lasted {cut_s} s")
    assert not netbed.our_namespaces(os.getpid()), "the bed left namespaces behind"
