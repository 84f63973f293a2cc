"""What a worker offers of one kind of accelerator, given its flag and what discovery
found: the same rule for GPUs (`--gpu`) and TPU chips (`--tpu`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from berth.shared.messages import DeviceInfo

log = logging.getLogger("berth.worker")


class OfferError(ValueError):
    """A device flag that asks for what the host does not have (one line, for the user)."""


@dataclass(frozen=True)
class Kind:
    """How one kind of device is named in the flag's messages."""

    name: str  # "GPU"
    plural: str  # "GPUs", "chips"
    found_by: str  # "NVML found", "found"


GPU = Kind("GPU", "GPUs", "NVML found")
TPU = Kind("TPU", "chips", "found")


def offered_devices(kind: Kind, flag: str, variant: str, count: int, found_variant: str,
                    found: tuple[DeviceInfo, ...], note: str) -> tuple[DeviceInfo, ...]:
    """The devices a flag (`flag` is its text, for messages) offers. Where nothing was
    discovered they are numbered 0..COUNT-1, unchecked (with a warning); where devices were
    found the flag may offer fewer (the first COUNT) but not more, nor another variant."""
    if count < 1:
        raise OfferError(f"{flag}: COUNT must be at least 1")
    if not found:
        log.warning("%s: no %s discovered (%s); offering %s 0..%d unchecked", flag, kind.name,
                    note or "none found", kind.plural, count - 1)
        return tuple(DeviceInfo(index=i) for i in range(count))
    if count > len(found):
        raise OfferError(f"{flag}: asks for {count} {kind.plural}, {kind.found_by} "
                         f"{len(found)} ({found[0].model})")
    if variant != found_variant:
        raise OfferError(f"{flag}: {kind.found_by} {found_variant} {kind.plural} "
                         f"({found[0].model}), not {variant}")
    return found[:count]
