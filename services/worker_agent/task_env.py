"""What a task's process sees in its environment: its spec's `env`, berth's task variables,
and from the worker's own environment only what a program needs to run (a documented
allow-list). Never the worker's NATS credentials, Redis URL, API token or data dir: a task
is user code, and the cluster's secrets would let it act as the cluster.

GPU isolation is set here last, so neither the spec's `env` nor the worker's own
environment can widen it: a task sees exactly the GPUs reserved for it, and a task that
asked for none sees none (CUDA_VISIBLE_DEVICES=""). TPU chips likewise (tpus.visibility:
TPU_VISIBLE_CHIPS and the process bounds libtpu reads)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from berth.shared.messages import GpuDevice, Resources

# From the worker's environment, only these reach a task (docs/configuration.md).
INHERITED = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL",
             "LC_CTYPE", "TZ", "TMPDIR", "TERM")


def gpu_devices(resources: Resources, devices: Sequence[str] | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for an attempt: "" for a task that asked for no GPU, its
    reserved devices' ids for one that did, None (left unset) for a GPU task whose run
    command came from a scheduler that predates pinning and named none."""
    if not isinstance(resources.device, GpuDevice):
        return ""
    if devices is None:
        return None
    return ",".join(devices)


def inherited(worker_env: Mapping[str, str]) -> dict[str, str]:
    """What of the worker's environment reaches its tasks: read once by the agent (each of
    os.environ's lookups encodes and decodes, ~50 µs per attempt for the allow-list)."""
    return {name: worker_env[name] for name in INHERITED if name in worker_env}


def task_environment(worker_env: Mapping[str, str], task_env: Mapping[str, str],
                     worker_id: str, visible_gpus: str | None = "",
                     tpu_env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = inherited(worker_env)
    env.update(task_env)
    env["BERTH_WORKER_ID"] = worker_id
    if visible_gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_gpus
        if visible_gpus:
            # Indices (where no UUID is known) then mean what nvidia-smi and NVML number,
            # not CUDA's default fastest-first order.
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.update(tpu_env or {})
    return env
