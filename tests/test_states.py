"""states.TaskStates and states.JobStates: the enums' members as plain class attributes
(the fold's fast lookups), exactly and nothing else."""

from __future__ import annotations

import enum

import pytest

from berth.shared.states import JobState, JobStates, TaskState, TaskStates


@pytest.mark.parametrize(("plain", "enum_type"), [(TaskStates, TaskState), (JobStates, JobState)])
def test_the_plain_state_classes_hold_exactly_the_enums_members(
        plain: type, enum_type: type[enum.IntEnum]) -> None:
    names = {n for n in vars(plain) if n.isupper()}
    assert names == set(enum_type.__members__)
    for name in names:
        assert getattr(plain, name) is enum_type[name]
