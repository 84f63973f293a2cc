"""A task's rarely set fields live in a TaskMore made on the first non-default write
(shared/lifecycle.py): read and written as the task's own attributes, kept through a
snapshot's round trip, and never made for a default."""

from __future__ import annotations

import msgspec
import pytest

from berth.shared.lifecycle import TaskMore, TaskView

MORE_FIELDS = TaskMore.__struct_fields__
# A value other than each field's default.
OTHER = {"failure_count": 2, "preemption_count": 3, "resume_count": 1,
         "stopped_with_gang": True, "retries": 4, "retry_since": 12.5, "retry_at": 99.0,
         "retries_ended": True, "refused_reports": ("stale",), "burned_attempt_id": 7}


def test_every_rare_field_is_a_task_attribute_and_not_a_task_field() -> None:
    assert set(MORE_FIELDS) == set(OTHER)
    assert not set(MORE_FIELDS) & set(TaskView.__struct_fields__)
    for name in MORE_FIELDS:
        assert hasattr(TaskView, name)


@pytest.mark.parametrize("name", MORE_FIELDS)
def test_a_default_write_makes_nothing_and_a_real_one_keeps_it(name: str) -> None:
    task = TaskView(job_id="j1", index=0)
    default = getattr(TaskMore(), name)
    assert getattr(task, name) == default
    setattr(task, name, default)
    assert task.more is None
    setattr(task, name, OTHER[name])
    assert getattr(task, name) == OTHER[name]
    assert task.more is not None and getattr(task.more, name) == OTHER[name]
    # The other fields still read their defaults.
    for other in MORE_FIELDS:
        if other != name:
            assert getattr(task, other) == getattr(TaskMore(), other)
    # Back to the default: read as such, the TaskMore stays.
    setattr(task, name, default)
    assert getattr(task, name) == default


def test_tasks_never_share_their_rare_fields() -> None:
    a, b = TaskView(job_id="j1", index=0), TaskView(job_id="j1", index=1)
    a.failure_count += 1
    a.retry_at = 5.0
    assert (b.failure_count, b.retry_at, b.more) == (0, 0.0, None)
    b.failure_count += 1
    assert a.more is not b.more and (a.failure_count, b.failure_count) == (1, 1)


@pytest.mark.parametrize("codec", [msgspec.msgpack, msgspec.json])
def test_a_round_trip_keeps_them(codec: object) -> None:
    task = TaskView(job_id="j1", index=0)
    plain = codec.decode(codec.encode(task), type=TaskView)  # type: ignore[attr-defined]
    assert plain == task and plain.more is None
    for name, value in OTHER.items():
        setattr(task, name, value)
    back = codec.decode(codec.encode(task), type=TaskView)  # type: ignore[attr-defined]
    assert back == task
    assert {name: getattr(back, name) for name in MORE_FIELDS} == OTHER
