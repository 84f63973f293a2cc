"""Resource amounts as whole numbers (millicores, MiB, device count): the arithmetic the
placement, the fold, the Lua scripts and the checker all share. Never floats."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

DIMENSIONS = ("cpu", "mem", "disk", "dev")


class Amounts(msgspec.Struct, frozen=True, gc=False):
    """Made by the hundred thousand (every fold adds and subtracts them per event): a
    msgspec Struct builds in ~0.1 µs where a frozen dataclass took ~0.8 µs, and encodes
    to the same map, so snapshots read either way."""

    cpu: int = 0  # millicores
    mem: int = 0  # MiB
    disk: int = 0  # MiB
    dev: int = 0  # accelerator devices (GPUs, TPU chips) of the host's one device kind

    def __add__(self, other: Amounts) -> Amounts:
        return Amounts(self.cpu + other.cpu, self.mem + other.mem, self.disk + other.disk,
                       self.dev + other.dev)

    def __sub__(self, other: Amounts) -> Amounts:
        return Amounts(self.cpu - other.cpu, self.mem - other.mem, self.disk - other.disk,
                       self.dev - other.dev)

    def fits_in(self, free: Amounts) -> bool:
        return (self.cpu <= free.cpu and self.mem <= free.mem and self.disk <= free.disk
                and self.dev <= free.dev)

    def exceeded(self, capacity: Amounts) -> list[str]:
        """The dimensions where these amounts exceed `capacity` (empty when they fit)."""
        return [d for d in DIMENSIONS if getattr(self, d) > getattr(capacity, d)]

    def as_dict(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMENSIONS}


@dataclass(frozen=True)
class GroupClaim:
    """A gang taking a coscheduling group ("tpu-name=slice-a"): exclusive unless the job
    declared it shareable."""

    name: str
    job_id: str
    members: tuple[str, ...]  # worker ids
    exclusive: bool = True
