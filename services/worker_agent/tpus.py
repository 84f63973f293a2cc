"""The worker's TPU chips: discovered from what a Cloud TPU VM (or a GKE TPU node) exposes,
or taken from `--tpu VARIANT:TOPOLOGY:COUNT` where nothing is found; and the variables that
give one task exactly its chips of the host (docs/tpus.md names every source).

Discovery reads the environment and files under a root directory (`/` on a real host, a
fixture directory in tests). The GCE metadata server is asked only when the operator says
so (`--tpu-metadata`), with a short timeout: a worker off Google Cloud must never wait on a
network call that cannot answer."""

from __future__ import annotations

import logging
import re
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from berth.services.worker_agent.device_offer import TPU, offered_devices
from berth.shared.messages import DeviceInfo

log = logging.getLogger("berth.worker")

# PCI ids of TPU chips, as torch_xla's `num_available_chips` counts them.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = frozenset({"0x0027", "0x005e", "0x0063", "0x006f", "0x0062", "0x0076"})

# The accelerator type's generation (what precedes "-<cores or chips>") -> the variant a
# job asks for. Names not here keep their own generation ("v4", "v5p", "v6e" already are).
VARIANTS: dict[str, str] = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e",
                            "tpu7x": "v7x"}


def variant_of(accelerator_type: str) -> str:
    """"v5litepod-8" -> "v5e", "v4-16" -> "v4", "v5p-8" -> "v5p" (lower-cased)."""
    generation = accelerator_type.strip().lower().rsplit("-", 1)[0]
    return VARIANTS.get(generation, generation)


@dataclass(frozen=True)
class Tpus:
    """What the host exposes: its chips, their variant and the slice's topology ("" where
    unknown), this host's worker number in the slice and the slice's hosts, or why none."""

    devices: tuple[DeviceInfo, ...] = ()
    variant: str = ""
    topology: str = ""
    worker_id: str = ""
    hostnames: tuple[str, ...] = ()
    note: str = ""


def count_chips(root: Path) -> int:
    """TPU chips on the PCI bus, else the device files libtpu opens: /dev/accel* (v2-v4)
    or the numbered /dev/vfio/* groups (v5e and later)."""
    pci = 0
    for vendor in root.glob("sys/bus/pci/devices/*/vendor"):
        device = vendor.with_name("device")
        try:
            if (vendor.read_text().strip() == GOOGLE_PCI_VENDOR
                    and device.read_text().strip() in TPU_PCI_DEVICES):
                pci += 1
        except OSError:
            continue
    if pci:
        return pci
    accel = [p for p in root.glob("dev/accel*") if re.fullmatch(r"accel[0-9]+", p.name)]
    if accel:
        return len(accel)
    return len([p for p in root.glob("dev/vfio/*") if p.name.isdigit()])


def discover(root: Path, env: Mapping[str, str]) -> Tpus:
    """The chips under `root`, described by the variables a TPU VM's runtime (and GKE)
    sets: TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY, TPU_WORKER_ID, TPU_WORKER_HOSTNAMES."""
    chips = count_chips(root)
    if not chips:
        return Tpus(note="no TPU chip on the PCI bus, /dev/accel* or /dev/vfio/*")
    accelerator = env.get("TPU_ACCELERATOR_TYPE", "").strip()
    if not accelerator:
        return Tpus(note=f"{chips} TPU chips found but TPU_ACCELERATOR_TYPE is not set "
                    "(name them with --tpu VARIANT:TOPOLOGY:COUNT)")
    topology = env.get("TPU_TOPOLOGY", "").strip().lower()
    if topology and not re.fullmatch(r"[0-9]+(x[0-9]+){0,3}", topology):
        log.warning("TPU_TOPOLOGY %r is not like 2x2x1; offering no topology", topology)
        topology = ""
    hostnames = tuple(h.strip() for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",")
                      if h.strip())
    return Tpus(tuple(DeviceInfo(index=i, model=accelerator) for i in range(chips)),
                variant_of(accelerator), topology, env.get("TPU_WORKER_ID", "").strip(),
                hostnames)


def describe(devices: Sequence[DeviceInfo]) -> str:
    """One line for the registration log."""
    what = devices[0].model if devices and devices[0].model else "unchecked"
    return f"{len(devices)} TPU chip{'s' if len(devices) != 1 else ''} ({what})"


# Where a TPU VM's metadata server keeps the instance attributes (`--tpu-metadata`'s default).
GCE_ATTRIBUTES = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
METADATA_TIMEOUT = 1.0  # seconds per attribute: the server answers locally or not at all


def _attribute(base: str, key: str, timeout: float) -> str:
    request = urllib.request.Request(base.rstrip("/") + "/" + key,
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return str(response.read().decode()).strip()
    except (urllib.error.URLError, OSError, UnicodeDecodeError) as exc:
        log.debug("TPU metadata %s: %s", key, exc)
        return ""


def metadata_environment(base: str = GCE_ATTRIBUTES, timeout: float = METADATA_TIMEOUT
                         ) -> dict[str, str]:
    """The TPU_* variables discovery reads, from a TPU VM's metadata attributes (what a GCE
    TPU VM offers where GKE would set the variables): `accelerator-type`,
    `agent-worker-number`, `worker-network-endpoints` ("host:uid:ip,..."), and TOPOLOGY in
    the `tpu-env` YAML. Attributes that do not answer are left out."""
    env: dict[str, str] = {}
    accelerator = _attribute(base, "accelerator-type", timeout)
    if not accelerator:
        return env  # not a TPU VM (or no server): ask no further
    env["TPU_ACCELERATOR_TYPE"] = accelerator
    if worker := _attribute(base, "agent-worker-number", timeout):
        env["TPU_WORKER_ID"] = worker
    endpoints = _attribute(base, "worker-network-endpoints", timeout)
    ips = [parts[2] for e in endpoints.split(",") if len(parts := e.split(":")) >= 3]
    if ips:
        env["TPU_WORKER_HOSTNAMES"] = ",".join(ips)
    try:
        tpu_env = yaml.safe_load(_attribute(base, "tpu-env", timeout) or "{}")
    except yaml.YAMLError:
        tpu_env = None
    if isinstance(tpu_env, dict) and tpu_env.get("TOPOLOGY"):
        env["TPU_TOPOLOGY"] = str(tpu_env["TOPOLOGY"])
    return env


def offered(tpus: Tpus, flag: tuple[str, str, int] | None
            ) -> tuple[str, str, tuple[DeviceInfo, ...]]:
    """The (variant, topology, chips) a worker offers: what was discovered, or `flag`'s
    (variant, topology, count) under device_offer's rule."""
    if flag is None:
        return tpus.variant, tpus.topology, tpus.devices
    variant, topology, count = flag
    return variant, topology, offered_devices(
        TPU, f"--tpu {variant}:{topology}:{count}", variant, count, tpus.variant, tpus.devices,
        tpus.note)


def attributes(tpus: Tpus) -> dict[str, str]:
    """Worker attributes a gang can order by (`tpu-worker-id`) when discovered."""
    return {"tpu-worker-id": tpus.worker_id} if tpus.devices and tpus.worker_id else {}


# Chips per process as libtpu's TPU_CHIPS_PER_PROCESS_BOUNDS shapes them on one host
# (x,y,z): the shapes of the process-per-subset examples (skye's tpu_topology_env_vars).
CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
# libtpu's default process port (torch_xla's configure_topology base_port).
BASE_PORT = 8476


def visibility(is_tpu_task: bool, chips: Sequence[str] | None, host_chips: int
               ) -> dict[str, str]:
    """The variables that confine a task to part of its host's `host_chips` chips:
    TPU_VISIBLE_CHIPS (the chips' indices), one process over them (TPU_PROCESS_BOUNDS
    1,1,1, CLOUD_TPU_TASK_ID 0) shaped by TPU_CHIPS_PER_PROCESS_BOUNDS, on its own port
    (TPU_PROCESS_PORT, BASE_PORT + its lowest chip: chips are never shared, so neither is
    the port). A task holding every chip gets none of them: libtpu's defaults are the whole
    host, joined with the slice's other hosts, which a gang over a `tpu-name` slice needs
    (as Ray leaves them for a task holding the whole node). A task that asked for no TPU
    gets TPU_VISIBLE_CHIPS=""; a TPU task from a scheduler that named no chips, nothing."""
    if not is_tpu_task:
        return {"TPU_VISIBLE_CHIPS": ""}
    if chips is None:
        return {}
    indices = sorted(int(c) for c in chips if c.isdigit())
    if len(indices) >= host_chips:
        return {}
    port = str(BASE_PORT + (indices[0] if indices else 0))
    env = {"TPU_VISIBLE_CHIPS": ",".join(map(str, indices)),
           "TPU_PROCESS_BOUNDS": "1,1,1", "CLOUD_TPU_TASK_ID": "0",
           "TPU_PROCESS_PORT": port, "TPU_PROCESS_ADDRESSES": f"localhost:{port}"}
    if len(indices) in CHIP_BOUNDS:
        env["TPU_CHIPS_PER_PROCESS_BOUNDS"] = CHIP_BOUNDS[len(indices)]
    return env
