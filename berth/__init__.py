"""berth: a cluster job scheduler. The public Python facade is small:

    from berth import submit_job, JobSpec
    outcome = await submit_job("nats://127.0.0.1:4222", JobSpec(name="hi", command=["echo"]))

Everything else lives in `berth.shared` and `berth.services` (the folders `shared/` and
`services/` at the top of the repository; docs/decisions.md, "One namespace").
"""

from berth.client import SubmitOutcome, submit_job, wait_for_outcome
from berth.shared.messages import JobSpec, Resources

__all__ = ["JobSpec", "Resources", "SubmitOutcome", "submit_job", "wait_for_outcome"]
