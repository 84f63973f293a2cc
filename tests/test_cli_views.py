"""What `berth watch` and `berth why` draw, from the API's JSON (pure: no stack)."""

from __future__ import annotations

import io

from rich.console import Console

from berth import cli_views

JOB = {"job_id": "j7-abcd", "name": "train", "state": "running", "waiting_for": "",
       "task_counts": {"running": 3, "pending": 1},
       "tasks": [{"index": i, "state": "running", "pending_reason": ""} for i in range(3)]
       + [{"index": 3, "state": "pending", "pending_reason": "no worker has 64 cpu free"}]}


def test_watch_draws_a_bar_per_task_state_with_its_count() -> None:
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(cli_views.watch_view(JOB))
    lines = out.getvalue().splitlines()
    assert lines[0] == "job j7-abcd (train): running"
    assert lines[1].startswith("pending") and lines[1].endswith("1/4")
    assert lines[2].startswith("running") and lines[2].endswith("3/4")


def test_why_gives_each_pending_tasks_reason_and_the_jobs_place() -> None:
    place = {"band": "batch", "position": 2, "of": 5}
    assert cli_views.why_lines(JOB, place) == [
        "job j7-abcd (train): 1 of 4 tasks pending",
        "  queue: position 2 of 5 in band batch (placed in band order, then users by fair "
        "share, each user's jobs first come first served)",
        "  task 3: no worker has 64 cpu free"]
    ended = {**JOB, "state": "succeeded", "tasks": []}
    assert cli_views.why_lines(ended, None) == [
        "job j7-abcd (train) is succeeded: no task is pending"]
