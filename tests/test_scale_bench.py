"""`bench/scale.py --quick` (W1-W8 and P1) runs end to end against the real services and
simulated hosts (P1: real worker agents), prints one well-formed JSON line per workload,
and every checker run finds zero violations. The numbers themselves are not asserted (they
are the benchmark's to report)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

THROUGHPUT_KEYS = {"placements_per_s", "completions_per_s", "submit_to_assigned_p50_ms",
                   "submit_to_assigned_p99_ms", "submit_to_running_p50_ms",
                   "submit_to_running_p99_ms", "scheduler_peak_rss_mib", "placed", "jobs"}


def test_quick_scale_benchmark_is_well_formed_and_w2_and_w5_are_clean() -> None:
    done = subprocess.run([sys.executable, "bench/scale.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    by_name: dict[str, list[dict[str, object]]] = {}
    for result in results:
        by_name.setdefault(str(result["workload"]), []).append(result)
    assert set(by_name) == {"W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "P1"}
    assert set(by_name["W1"][0]) >= THROUGHPUT_KEYS
    for result in (*by_name["W1"], *by_name["W4"], *by_name["P1"]):
        assert result["doctor_violations"] == 0 and result["doctor_double_booked_hosts"] == 0
    assert by_name["W1"][0]["scheduler_cpu_ms_per_placement"] > 0
    w1 = by_name["W1"][0]
    assert 0 < w1["slots_busy"] <= 1 and w1["slot_held_s"] > 0, w1  # type: ignore[operator]
    assert w1["slot_bound_per_s"] and w1["exit_to_slot_refilled_p50_ms"] is not None, w1
    # P1: real worker agents ran every `true` job, and its CPU is counted per job.
    p1 = by_name["P1"][0]
    assert p1["finished"] == p1["jobs"] and p1["failed"] == 0, p1
    # Per process, CPU is read in whole clock ticks: 12 jobs' worth, up to the stream's last
    # event, may read 0 (the machine's count below misses nothing).
    assert p1["berth_cpu_ms_per_job"] >= 0 and p1["submit_to_succeeded_p50_ms"] is not None
    assert p1["assigned_to_running_p50_ms"] is not None
    assert p1["running_to_finished_p50_ms"] is not None
    assert p1["exit_to_slot_refilled_p50_ms"] is not None  # 12 jobs on 4 slots
    # The whole machine's count, split into the tasks' own (their exit reports: each `true`
    # used some) and berth's stack.
    assert p1["task_cpu_ms_per_job"] > 0 and p1["machine_cpu_ms_per_job"] > 0
    assert abs(p1["machine_cpu_ms_per_job"] - p1["task_cpu_ms_per_job"]
               - p1["stack_cpu_ms_per_job"]) < 0.01
    assert by_name["W2"][0]["slice_free_to_next_gang_p50_ms"] is not None
    assert len(by_name["W4"]) >= 1 and all(set(r) >= THROUGHPUT_KEYS for r in by_name["W4"])
    for w2 in (*by_name["W2"], *by_name["W8"]):
        assert w2["doctor_violations"] == 0 and w2["doctor_double_booked_hosts"] == 0
        assert w2["gangs_placed"] == w2["gangs"]
    assert by_name["W8"][0]["slices"] == by_name["W8"][0]["gangs"]  # a slice each
    assert {"submit_to_running_p50_ms", "submit_to_running_p99_ms"} <= set(by_name["W3"][0])
    w5 = by_name["W5"][0]
    assert w5["doctor_violations"] == 0 and w5["doctor_double_booked_hosts"] == 0
    assert w5["gangs_running"] == w5["gangs"] and w5["evictions"] == w5["gangs"] * 8
    assert {"evictions_per_s", "time_to_all_running_s", "placed_after_last_victim_max_s",
            "exit_to_assigned_p50_s", "assigned_to_running_p50_s"} <= set(w5)
    w6 = by_name["W6"][0]
    assert w6["full"] and w6["placed"] == w6["slots"], w6  # not one task beyond the slots
    assert w6["doctor_violations"] == 0 and w6["doctor_double_booked_hosts"] == 0
    assert "scheduler" in w6["cores"]  # type: ignore[operator]
    w7 = by_name["W7"][0]
    assert w7["full"] and w7["placed"] > w7["slots"], w7  # freed slots were refilled
    assert w7["doctor_violations"] == 0 and w7["doctor_double_booked_hosts"] == 0
    assert "workload" in done.stderr and "placements/s" in done.stderr  # the table


def _scale_module() -> ModuleType:
    """bench/scale.py as a module (it imports its neighbours in bench/ by name)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import scale

    return scale


@pytest.mark.parametrize(("tasks", "slots", "want"), [
    # (assigned, finished) per task. Two slots; the third task takes the first one freed.
    ([(0.0, 1.0), (0.0, 2.0), (1.5, 2.5)], 2,
     {"slot_held_s": 1.333, "slots_busy": 0.833, "slot_bound_per_s": 2}),
    # The last placement ends the window: the third slot was empty all through it.
    ([(0.0, 3.0), (0.0, 3.0), (1.0, 2.0)], 3,
     {"slot_held_s": 2.333, "slots_busy": 0.667, "slot_bound_per_s": 1}),
    ([(0.0, 4.0), (2.0, 4.0)], 1, {"slot_held_s": 3.0, "slots_busy": 1.0, "slot_bound_per_s": 0}),
    # One placement: no window to be busy in.
    ([(5.0, 6.0)], 4, {"slot_held_s": 1.0, "slots_busy": None, "slot_bound_per_s": 4}),
    ([], 4, {"slot_held_s": None, "slots_busy": None, "slot_bound_per_s": None}),
])
def test_slot_use_is_littles_law_over_the_stamps(
        tasks: list[tuple[float, float]], slots: int, want: dict[str, object]) -> None:
    scale = _scale_module()
    seen = scale.Observed()
    for i, (assigned, finished) in enumerate(tasks):
        seen.assigned[(f"j{i}", 0)] = assigned
        seen.finished[(f"j{i}", 0)] = finished
    seen.assigned[("never-finished", 0)] = 0.0  # counted only once it exits
    assert scale.slot_use(seen, slots) == want


async def test_a_run_still_going_when_the_stream_falls_quiet_is_followed_to_its_end(
        tmp_path: Path) -> None:
    """The benchmark reads the events stream only once it has been quiet for a while
    (`Cluster.when_quiet`). A job that runs longer than that quiet (RUNNING, then nothing for
    2.5 s) must not end the run early: the benchmark reads what it missed, sees the job still
    running, and follows the stream until it ends; the figures are taken then."""
    scale = _scale_module()
    async with scale.Cluster(tmp_path, "quiet", 1, ["--cpu", "1", "--memory-mb", "512",
                                                     "--sim-runtime", "const:2.5"]) as c:
        seen = c.seen
        c.stop_following()
        await scale.submit_all(c.nc, seen, [scale.single(0)])
        before = time.monotonic()
        complete, taken_at = await c.when_quiet(lambda: len(seen.finished) >= 1, 30,
                                                "the job", time.monotonic)
        assert complete and len(seen.finished) == 1 and len(seen.running) == 1
        assert len(seen.assigned) == 1 and len(seen.submitted_at) == 1
        # Not when the stream first fell quiet (~1 s in), but once the job had ended.
        assert taken_at - before >= 2.0


async def test_w5_tick_benchmark_commits_every_eviction_both_ways() -> None:
    """bench/w5_tick.py, small and in-process: every preemptor's eviction is committed one
    call each and in one call, and every production gang is placed once its victims are
    gone."""
    spec = importlib.util.spec_from_file_location("w5_tick", ROOT / "bench" / "w5_tick.py")
    assert spec is not None and spec.loader is not None
    w5_tick = importlib.util.module_from_spec(spec)
    sys.modules["w5_tick"] = w5_tick  # dataclasses look their module up
    spec.loader.exec_module(w5_tick)
    result = await w5_tick.run(slices=5, gangs=3, repeat=1)
    assert result["evictions"] == 3 and result["placed_tasks"] == 3 * 8


def test_tick_hold_benchmark_sweeps_every_waiting_task_and_places_past_a_backlog() -> None:
    """bench/tick_hold.py --quick, in a process of its own: on a full cluster the walk
    places nothing and the sweep gives every waiting task its reason, as the whole walk
    does; behind a GPU backlog the walk leaves the GPU jobs out and places the cpu jobs,
    and the sweep gives the GPU jobs the whole walk's reasons."""
    done = subprocess.run([sys.executable, "bench/tick_hold.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    full, backlog = map(json.loads, done.stdout.splitlines())
    assert full["walk_placed"] == 0 and full["walk_stopped_short"]
    assert full["sweep_reasons"] == full["whole_walk_reasons"] == full["waiting"]
    assert full["sweep_slices"] >= 1 and full["sweep_slice_max_s"] > 0
    assert backlog["walk_placed"] == 10 and backlog["walk_reasons"] == 0
    assert backlog["needs_left_out"] == 1
    assert backlog["sweep_reasons"] == backlog["whole_walk_reasons"] == backlog["waiting"] - 10
    assert "walk_s" in done.stderr  # the summary


@pytest.mark.slow
def test_quick_scale_benchmark_runs_on_three_nats_nodes() -> None:
    done = subprocess.run([sys.executable, "bench/scale.py", "--quick", "--only", "W1,W2",
                           "--nats-nodes", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["workload"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert set(results) == {"W1", "W2"}
    assert all(r["nats_nodes"] == 3 and r["stream_replicas"] == 3 for r in results.values())
    assert set(results["W1"]) >= THROUGHPUT_KEYS | {"nats_cpu_s"}
    assert results["W1"]["placed"] == results["W1"]["jobs"]
    assert results["W2"]["doctor_violations"] == 0
    assert results["W2"]["gangs_placed"] == results["W2"]["gangs"]
