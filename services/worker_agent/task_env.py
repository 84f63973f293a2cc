"""What a task's process sees in its environment: its spec's `env`, berth's task variables,
and from the worker's own environment only what a program needs to run (a documented
allow-list). Never the worker's NATS credentials, Redis URL, API token or data dir: a task
is user code, and the cluster's secrets would let it act as the cluster."""

from __future__ import annotations

from collections.abc import Mapping

# From the worker's environment, only these reach a task (docs/configuration.md).
INHERITED = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL",
             "LC_CTYPE", "TZ", "TMPDIR", "TERM")


def task_environment(worker_env: Mapping[str, str], task_env: Mapping[str, str],
                     worker_id: str) -> dict[str, str]:
    env = {name: worker_env[name] for name in INHERITED if name in worker_env}
    env.update(task_env)
    env["BERTH_WORKER_ID"] = worker_id
    return env
