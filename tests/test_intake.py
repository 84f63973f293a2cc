from __future__ import annotations

from services.submitter.intake import intake, job_id_for
from shared.messages import JobSubmitted, SubmitRejected


def test_valid_submit_becomes_a_job_with_a_stable_id() -> None:
    out = intake(b'{"name": "a", "command": ["true"], "replicas": 2}', 7, 123, 1000)
    assert isinstance(out, JobSubmitted)
    assert out.job_id == job_id_for(7, 123) and out.job_id.startswith("j7-")
    assert out.spec.replicas == 2 and out.spec.max_retries_preemption == 100
    again = intake(b'{"name": "a", "command": ["true"], "replicas": 2}', 7, 123, 1000)
    assert isinstance(again, JobSubmitted) and again.job_id == out.job_id


def test_every_bad_input_is_a_rejection_never_an_exception() -> None:
    cases = [b"", b"\xff\xfe", b"null", b"{", b'{"name": "a b", "command": ["x"]}',
             b'{"name": "a", "command": ["x"], "env": {"1BAD": "v"}}',
             b'{"name": "a", "command": ["x"], "v": 99}', b"x" * 2000]
    for payload in cases:
        out = intake(payload, 1, 0, 1000)
        assert isinstance(out, SubmitRejected), payload
        assert out.reason
