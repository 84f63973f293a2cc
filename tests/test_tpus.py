"""TPU discovery from what a Cloud TPU VM exposes (fixture directories standing in for its
/sys and /dev, a dict for its environment: CI has no TPU), `--tpu` against what was found,
and the variables that confine a task to its chips."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from berth.services.worker_agent import tpus
from berth.services.worker_agent.service import parse_args
from berth.services.worker_agent.task_env import task_environment
from berth.shared.messages import DeviceInfo, GpuDevice, TpuDevice

V5E_ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_TOPOLOGY": "4x4",
           "TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "t-w-0,t-w-1,t-w-2,t-w-3"}


def pci_chips(root: Path, chips: int, device: str = "0x0063") -> Path:
    """A /sys/bus/pci/devices with `chips` TPU chips beside an unrelated NIC."""
    devices = root / "sys/bus/pci/devices"
    for i, (vendor, dev) in enumerate([("0x1ae0", device)] * chips + [("0x8086", "0x1572")]):
        slot = devices / f"0000:00:{i + 4:02x}.0"
        slot.mkdir(parents=True)
        (slot / "vendor").write_text(vendor + "\n")
        (slot / "device").write_text(dev + "\n")
    return root


def dev_files(root: Path, *names: str) -> Path:
    for name in names:
        (root / "dev" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "dev" / name).write_text("")
    return root


@pytest.mark.parametrize(("accelerator", "variant"), [
    ("v5litepod-8", "v5e"), ("v5litepod-256", "v5e"), ("v4-16", "v4"), ("v5p-8", "v5p"),
    ("v6e-4", "v6e"), ("v3-8", "v3"), ("V2-8", "v2"), ("tpu7x-8", "v7x")])
def test_accelerator_types_map_to_variants(accelerator: str, variant: str) -> None:
    assert tpus.variant_of(accelerator) == variant


@pytest.mark.parametrize(("layout", "chips"), [
    ("pci", 4), ("pci-other-google-device", 0), ("accel", 4), ("vfio", 8), ("none", 0)])
def test_chips_are_counted_from_the_pci_bus_or_device_files(
        tmp_path: Path, layout: str, chips: int) -> None:
    match layout:
        case "pci":
            pci_chips(tmp_path, 4)
        case "pci-other-google-device":
            pci_chips(tmp_path, 2, device="0x9999")
        case "accel":  # v2-v4: one file per chip; accel-foo is not a chip
            dev_files(tmp_path, "accel0", "accel1", "accel2", "accel3", "accel-foo")
        case "vfio":  # v5e and later: numbered IOMMU groups beside the vfio control file
            dev_files(tmp_path, "vfio/vfio", *(f"vfio/{i}" for i in range(8)))
    assert tpus.count_chips(tmp_path) == chips


def test_discovery_reads_variant_topology_and_worker_from_the_environment(
        tmp_path: Path) -> None:
    found = tpus.discover(pci_chips(tmp_path, 4), V5E_ENV)
    assert found.devices == tuple(DeviceInfo(index=i, model="v5litepod-16") for i in range(4))
    assert (found.variant, found.topology, found.worker_id) == ("v5e", "4x4", "2")
    assert found.hostnames == ("t-w-0", "t-w-1", "t-w-2", "t-w-3")
    assert tpus.attributes(found) == {"tpu-worker-id": "2"}


def test_no_chips_or_no_accelerator_type_means_no_tpus(tmp_path: Path) -> None:
    assert tpus.discover(tmp_path, V5E_ENV).devices == ()
    unnamed = tpus.discover(pci_chips(tmp_path, 4), {})
    assert unnamed.devices == ()
    assert "TPU_ACCELERATOR_TYPE is not set" in unnamed.note
    bad = tpus.discover(tmp_path, {**V5E_ENV, "TPU_TOPOLOGY": "four"})
    assert (len(bad.devices), bad.topology) == (4, "")


def test_discovered_chips_are_offered_without_a_flag(tmp_path: Path) -> None:
    args = parse_args(["--id", "w", "--cpu", "8"], nvml=None,
                      tpu_root=pci_chips(tmp_path, 4), environ=V5E_ENV)
    assert args.resources.device == TpuDevice(variant="v5e", topology="4x4", count=4)
    assert [d.index for d in args.devices] == [0, 1, 2, 3]
    assert args.attributes == {"tpu-worker-id": "2"}
    # An operator's -a wins over the discovered worker number.
    args = parse_args(["--id", "w", "-a", "tpu-worker-id=7"], nvml=None,
                      tpu_root=tmp_path, environ=V5E_ENV)
    assert args.attributes == {"tpu-worker-id": "7"}


def test_the_tpu_flag_numbers_chips_unchecked_where_none_are_found(tmp_path: Path) -> None:
    args = parse_args(["--id", "w", "--tpu", "v5p:2x2x1:4"], nvml=None, tpu_root=tmp_path,
                      environ={})
    assert args.resources.device == TpuDevice(variant="v5p", topology="2x2x1", count=4)
    assert args.devices == tuple(DeviceInfo(index=i) for i in range(4))
    # A GPU flag still offers GPUs on a host whose TPUs were found.
    args = parse_args(["--id", "w", "--gpu", "h100:1"], nvml=None,
                      tpu_root=pci_chips(tmp_path, 4), environ=V5E_ENV)
    assert args.resources.device == GpuDevice(variant="h100", count=1)


def test_the_tpu_flag_may_offer_fewer_chips_than_found_but_not_more(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = pci_chips(tmp_path, 4)
    args = parse_args(["--tpu", "v5e:2x2:2"], nvml=None, tpu_root=root, environ=V5E_ENV)
    assert len(args.devices) == 2
    assert args.resources.device == TpuDevice(variant="v5e", topology="2x2", count=2)
    for flag, why in (("v5e:4x4:8", "asks for 8 chips, found 4 (v5litepod-16)"),
                      ("v4:2x2x1:4", "found v5e chips (v5litepod-16), not v4"),
                      ("v5e:4x4:0", "COUNT must be at least 1")):
        with pytest.raises(SystemExit):
            parse_args(["--tpu", flag], nvml=None, tpu_root=root, environ=V5E_ENV)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith(f"--tpu {flag}: {why}"), err
        assert "Traceback" not in err


@pytest.mark.parametrize(("chips", "expected"), [
    (["0"], {"TPU_VISIBLE_CHIPS": "0", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
             "TPU_PROCESS_PORT": "8476", "TPU_PROCESS_ADDRESSES": "localhost:8476"}),
    (["3", "2"], {"TPU_VISIBLE_CHIPS": "2,3", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,2,1",
                  "TPU_PROCESS_PORT": "8478", "TPU_PROCESS_ADDRESSES": "localhost:8478"}),
    (["4", "5", "6", "7"], {"TPU_VISIBLE_CHIPS": "4,5,6,7",
                            "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
                            "TPU_PROCESS_PORT": "8480",
                            "TPU_PROCESS_ADDRESSES": "localhost:8480"}),
    ([str(i) for i in range(8)], {"TPU_VISIBLE_CHIPS": "0,1,2,3,4,5,6,7",
                                  "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,4,1",
                                  "TPU_PROCESS_PORT": "8476",
                                  "TPU_PROCESS_ADDRESSES": "localhost:8476"})])
def test_a_tpu_task_sees_exactly_its_chips_as_one_process(
        chips: list[str], expected: dict[str, str]) -> None:
    spec_env = {"TPU_VISIBLE_CHIPS": "0,1,2,3,4,5,6,7"}  # a spec cannot widen its share
    env = task_environment({"PATH": "/bin"}, spec_env, "w", "",
                           tpus.visibility(True, chips, 16))
    assert {k: env[k] for k in expected} == expected
    assert (env["TPU_PROCESS_BOUNDS"], env["CLOUD_TPU_TASK_ID"]) == ("1,1,1", "0")
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # and no GPU


def test_a_task_that_asked_for_no_tpu_sees_none() -> None:
    env = task_environment({"PATH": "/bin", "TPU_VISIBLE_CHIPS": "0,1,2,3"},
                           {"TPU_VISIBLE_CHIPS": "0"}, "w", "", tpus.visibility(False, [], 4))
    assert env["TPU_VISIBLE_CHIPS"] == ""
    assert "TPU_PROCESS_BOUNDS" not in env
    # A run command from a scheduler that predates pinning names no chips: left unset.
    assert "TPU_VISIBLE_CHIPS" not in task_environment({}, {}, "w", "",
                                                       tpus.visibility(True, None, 4))


def test_a_task_holding_every_chip_keeps_libtpus_defaults_to_join_its_slice() -> None:
    # A gang over a tpu-name slice: each task holds its whole host, and the hosts' libtpus
    # must form one slice, which one-process bounds would forbid.
    env = task_environment({}, {}, "w", "", tpus.visibility(True, ["0", "1", "2", "3"], 4))
    assert not {k for k in env if k.startswith(("TPU_", "CLOUD_TPU"))}


# What a v4-16 TPU VM's metadata server answers (attribute -> value), as torch_xla's and
# Ray's TPU code read it.
METADATA = {"accelerator-type": "v4-16", "agent-worker-number": "1",
            "worker-network-endpoints": "t-w-0:uid0:10.0.0.2,t-w-1:uid1:10.0.0.3",
            "tpu-env": "ACCELERATOR_TYPE: 'v4-16'\nTOPOLOGY: '2x2x2'\nWORKER_ID: '1'\n"}


class MetadataHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        key = self.path.rsplit("/", 1)[-1]
        ok = key in METADATA and self.headers.get("Metadata-Flavor") == "Google"
        body = METADATA[key].encode() if ok else b"not found"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), MetadataHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/computeMetadata/v1/instance/attributes/"
    finally:
        server.shutdown()
        server.server_close()


def test_a_tpu_vm_is_described_by_its_metadata_server_when_asked(
        tmp_path: Path, metadata_url: str) -> None:
    assert tpus.metadata_environment(metadata_url) == {
        "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3", "TPU_TOPOLOGY": "2x2x2"}
    root = dev_files(tmp_path, "accel0", "accel1", "accel2", "accel3")
    args = parse_args(["--id", "w", "--tpu-metadata", metadata_url], nvml=None,
                      tpu_root=root, environ={})
    assert args.resources.device == TpuDevice(variant="v4", topology="2x2x2", count=4)
    assert args.attributes == {"tpu-worker-id": "1"}
    # Not asked: the server is not consulted, and unnamed chips are not offered.
    assert parse_args(["--id", "w"], nvml=None, tpu_root=root, environ={}).devices == ()


def test_no_metadata_server_means_no_variables() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/"
    assert tpus.metadata_environment(closed, timeout=0.5) == {}
