"""The variables distributed-training frameworks read, derived from what berth already
knows about an attempt, so a user's program needs no glue (docs/gpus.md).

- torch.distributed (`init_process_group("nccl")`, env:// rendezvous): MASTER_ADDR,
  MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE.
- JAX: `jax.distributed.initialize()` reads JAX_COORDINATOR_ADDRESS itself; berth also sets
  JAX_NUM_PROCESSES and JAX_PROCESS_ID, which the program passes as `num_processes` and
  `process_id` (JAX reads no variable for those outside the clusters it detects).

A gang (coscheduling) is one world: task i is rank i of `replicas`, and the coordinator is
its task 0's address and first named port. Any other task is a world of one, coordinated
at its own address and first named port. Each task is one process on its own devices
(CUDA_VISIBLE_DEVICES), so its LOCAL_RANK is 0 of LOCAL_WORLD_SIZE 1; a task that starts
several processes itself (torchrun) sets theirs. Without a named port there is no
coordinator, and the address variables are not set."""

from __future__ import annotations

from collections.abc import Mapping

from berth.shared.messages import JobSpec


def variables(spec: JobSpec, task_index: int, address: str, ports: Mapping[str, int],
              coordinator: str) -> dict[str, str]:
    gang = spec.coscheduling is not None
    world, rank = (spec.replicas, task_index) if gang else (1, 0)
    env = {
        "WORLD_SIZE": str(world), "RANK": str(rank),
        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "JAX_NUM_PROCESSES": str(world), "JAX_PROCESS_ID": str(rank),
    }
    if not gang and spec.ports and spec.ports[0] in ports:
        coordinator = f"{address}:{ports[spec.ports[0]]}"
    if coordinator:
        host, _, port = coordinator.rpartition(":")
        env.update(MASTER_ADDR=host, MASTER_PORT=port, JAX_COORDINATOR_ADDRESS=coordinator)
    return env
