from __future__ import annotations

from berth.services.submitter.intake import intake, intake_cancel, unknown_subject
from berth.shared.job_ids import job_id_for, submit_seq_of
from berth.shared.messages import JobCancelRequested, JobSubmitted, SubmitRejected


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


def test_an_empty_command_or_a_nul_byte_is_rejected_with_the_field_named() -> None:
    cases = {
        b'{"name": "a", "command": []}': "command",
        b'{"name": "a", "command": [""]}': "command: the program (command[0]) is empty",
        b'{"name": "a", "command": ["  "]}': "command: the program (command[0]) is empty",
        b'{"name": "a", "command": ["echo", "a\\u0000b"]}': "command[1]: contains a NUL byte",
        b'{"name": "a", "command": ["x\\u0000"]}': "command[0]: contains a NUL byte",
        b'{"name": "a", "command": ["x"], "env": {"K": "\\u0000"}}': "env.K: contains a NUL",
        b'{"name": "a", "command": ["x"], "constraints": [{"key": "z", "op": "EQ", '
        b'"value": "eu", "mode": "soft"}]}':
            "Invalid enum value 'soft' - at `$.constraints[0].mode`",
        b'{"name": "a", "command": ["x"], "constraints": [{"key": "z", "op": "GT", '
        b'"value": "eu", "mode": "preferred"}]}': "constraint on 'z': GT needs a number",
    }
    for payload, why in cases.items():
        out = intake(payload, 1, 0, 1000)
        assert isinstance(out, SubmitRejected), payload
        assert out.reason.startswith("invalid job spec: ") and why in out.reason, out.reason
        assert "\n" not in out.reason


def test_job_ids_name_their_submit_sequence() -> None:
    assert submit_seq_of(job_id_for(42, 1)) == 42
    assert submit_seq_of("x42-abcd") is None and submit_seq_of("j-abcd") is None
    assert submit_seq_of("j42-zzzz") is None  # parsed by the same rule a message validates
    # What the submitter builds, a cancel message accepts as a job id.
    made = job_id_for(7, 99)
    out = intake_cancel(f'{{"job_id": "{made}", "reason": "r"}}'.encode(), 9, 1000)
    assert isinstance(out, JobCancelRequested) and out.job_id == made


def test_cancel_requests() -> None:
    out = intake_cancel(b'{"job_id": "j3-abcd", "reason": "r", "user": "u"}', 9, 1000)
    assert isinstance(out, JobCancelRequested)
    assert (out.job_id, out.submit_seq, out.reason, out.user) == ("j3-abcd", 9, "r", "u")
    for payload, why in [(b'{"job_id": "3"}', "$.job_id"), (b"{}", "job_id"),
                         (b'{"job_id": "j3-abcd", "force": true}', "force"),
                         (b'{"job_id": ', "malformed JSON"), (b"x" * 2000, "limit is 1000 bytes")]:
        rejected = intake_cancel(payload, 9, 1000)
        assert isinstance(rejected, SubmitRejected) and why in rejected.reason, payload
    assert "berth.submit.cancel" in unknown_subject("berth.submit.jobs", 3).reason


def test_a_spec_built_from_lists_equals_its_round_trip_and_keeps_no_empty_list() -> None:
    import msgspec

    from berth.shared.messages import Constraint, JobSpec, Op, decode, encode

    spec = JobSpec(name="x", command=["a", "b"], after=["j1-aaaa"],
                   constraints=[Constraint(key="zone", op=Op.EQ, value="a")])
    assert spec.command == ("a", "b") and spec.after == ("j1-aaaa",)
    assert decode(msgspec.json.Decoder(JobSpec), encode(spec)) == spec
    # The fold keeps every job's spec: its empty arrays are the one shared empty tuple.
    decoded = decode(msgspec.json.Decoder(JobSpec), b'{"name": "y", "command": ["true"]}')
    assert decoded.setup is () and decoded.ports is () and decoded.after_any is ()  # noqa: F632


def test_a_specs_empty_maps_are_one_read_only_object_and_its_strings_are_shared() -> None:
    import msgspec
    import pytest

    from berth.shared.messages import EMPTY, JobSpec, decode, encode

    decoder = msgspec.json.Decoder(JobSpec)
    one = decode(decoder, b'{"name": "a", "command": ["python", "train.py"], "user": "ann"}')
    two = decode(decoder, b'{"name": "b", "command": ["python", "train.py"], "user": "ann"}')
    assert one.env is EMPTY and one.tokens is EMPTY and two.env is EMPTY
    # Shared, so nothing may change it; and it is still an empty dict to every reader.
    with pytest.raises(TypeError, match="read-only"):
        one.env["X"] = "1"
    with pytest.raises(TypeError):
        one.tokens.update(gpu=1)
    assert one.env == {} and dict(one.env) == {}
    assert decode(decoder, encode(one)) == one
    assert one.user is two.user and one.command[0] is two.command[0]
    assert one.resources is two.resources
    long_arg = "x" * 300  # past the interned length: kept as decoded
    three = JobSpec(name="c", command=["run", long_arg], env={"K": "v"})
    assert three.env == {"K": "v"} and three.env is not EMPTY and three.command[1] == long_arg


def test_every_sequence_of_a_spec_built_from_lists_is_a_tuple_as_decoding_makes_it() -> None:
    # JobSpec.__post_init__ tests its sequence fields one attribute at a time before
    # converting (it runs for every decoded spec); a field added to _SPEC_SEQUENCES but not
    # to that test would stay a list here.
    import msgspec
    import pytest

    from berth.shared import messages
    from berth.shared.messages import Constraint, JobSpec, Op

    values = {"command": ["x"], "constraints": [Constraint(key="rack", op=Op.EXISTS)],
              "ports": ["http"], "setup": ["true"], "after": ["j1-aaaa"],
              "after_any": ["j2-bbbb"]}
    assert set(values) == set(messages._SPEC_SEQUENCES)
    for name, value in values.items():
        # Only this field a list: the others tuples already.
        spec = JobSpec(name="a", **{"command": ("x",), name: value})
        assert type(getattr(spec, name)) is tuple, name
        assert msgspec.json.decode(messages.encode(spec), type=JobSpec) == spec, name
    with pytest.raises(ValueError, match="after: job ids must be unique"):
        JobSpec(name="a", command=["x"], after=["j1-aaaa", "j1-aaaa"])
