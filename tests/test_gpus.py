"""GPU discovery (NVML behind a small interface, a fake here: CI has no GPU), the variant
table, `--gpu` against what was found, and what a task's environment says about GPUs."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from berth.services.scheduler import frameworks
from berth.services.worker_agent import gpu_health, gpu_telemetry, gpus
from berth.services.worker_agent.service import parse_args
from berth.services.worker_agent.task_env import gpu_devices, task_environment
from berth.shared.messages import (
    Coscheduling,
    DeviceInfo,
    GpuDevice,
    GpuTelemetry,
    JobSpec,
    Resources,
    TpuDevice,
)
from berth.spec_files import load_spec

GIB = 1024 ** 3
ROOT = Path(__file__).resolve().parent.parent


class FakeNvmlError(Exception):
    pass


@dataclass
class Memory:
    total: int
    used: int = 0


@dataclass
class Rates:
    gpu: int


@dataclass
class XidEvent:
    device: Any
    eventType: int
    eventData: int


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


@dataclass
class Sample:
    pid: int
    timeStamp: int
    smUtil: int


class FakeNvml:
    """The pynvml calls berth makes, over a list of (uuid, name, bytes) devices. For unit
    tests only: what a user runs always gets the real binding."""

    NVMLError = FakeNvmlError

    def __init__(self, devices: list[tuple[str, str | bytes, int]], fail_init: bool = False,
                 fail_at: int | None = None) -> None:
        self.devices = devices
        self.fail_init = fail_init
        self.fail_at = fail_at
        self.shut_down = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise FakeNvmlError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if index == self.fail_at:
            raise FakeNvmlError("GPU is lost")
        return index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self.devices[handle][0]

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self.devices[handle][1]

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Memory:
        return Memory(self.devices[handle][2], used=3 * GIB * handle)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Rates:
        return Rates(gpu=50 * handle)

    # Xid events waiting: (device index, Xid).
    xids: list[tuple[int, int]] = []
    registered: list[int] = []

    def nvmlEventSetCreate(self) -> Any:
        self.registered = []
        return "events"

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, events: Any) -> None:
        assert (event_types, events) == (gpu_health.XID_EVENTS, "events")
        self.registered.append(handle)

    def nvmlEventSetWait_v2(self, events: Any, timeout_ms: int) -> Any:
        if not self.xids:
            raise FakeNvmlError("Timeout")
        handle, xid = self.xids.pop(0)
        return XidEvent(handle, gpu_health.XID_EVENTS, xid)

    def nvmlEventSetFree(self, events: Any) -> None:
        self.registered = []

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if handle == 2:
            raise FakeNvmlError("Not Supported")
        return 40 + handle

    # Health: devices listed in `lost` are gone from the bus; `ecc` counts uncorrectable
    # errors per index (None: the model has no ECC).
    lost: tuple[str, ...] = ()
    ecc: dict[int, int | None] = {}

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        if uuid in self.lost:
            raise FakeNvmlError("GPU is lost")
        return next(i for i, d in enumerate(self.devices) if d[0] == uuid)

    # Telemetry: per device index, (pid, bytes) of its processes and (pid, timestamp, SM %)
    # utilisation samples.
    procs: dict[int, list[tuple[int, int | None]]] = {}
    util: dict[int, list[tuple[int, int, int]]] = {}

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return [Proc(pid, used) for pid, used in self.procs.get(handle, [])]

    def nvmlDeviceGetProcessUtilization(self, handle: Any, since: int) -> list[Any]:
        new = [Sample(p, ts, sm) for p, ts, sm in self.util.get(handle, []) if ts > since]
        if not new:
            raise FakeNvmlError("Not Found")
        return new

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (gpu_health.UNCORRECTED, gpu_health.VOLATILE)
        errors = self.ecc.get(handle, 0)
        if errors is None:
            raise FakeNvmlError("Not Supported")
        return errors


def h100s(n: int) -> FakeNvml:
    return FakeNvml([(f"GPU-{i:08x}", "NVIDIA H100 80GB HBM3", 80 * GIB) for i in range(n)])


@pytest.mark.parametrize(("model", "variant"), [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 NVL", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("Tesla T4", "t4"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada-generation"),  # the fallback
])
def test_model_names_map_to_variants(model: str, variant: str) -> None:
    assert gpus.variant_of(model) == variant


def test_discovery_lists_every_gpu_with_uuid_model_and_memory() -> None:
    nvml = FakeNvml([("GPU-a", b"NVIDIA H100 80GB HBM3", 80 * GIB),  # old bindings: bytes
                     ("GPU-b", "NVIDIA H100 80GB HBM3", 80 * GIB)])
    found = gpus.discover(nvml)
    assert found.variant == "h100"
    assert found.devices == (
        DeviceInfo(index=0, uuid="GPU-a", model="NVIDIA H100 80GB HBM3", memory_mb=81920),
        DeviceInfo(index=1, uuid="GPU-b", model="NVIDIA H100 80GB HBM3", memory_mb=81920))
    assert nvml.shut_down


def test_no_library_no_driver_or_a_failing_device_means_no_gpus() -> None:
    assert gpus.discover(None) == gpus.Gpus(note="nvidia-ml-py is not installed")
    assert gpus.discover(FakeNvml([], fail_init=True)).note == (
        "NVML unavailable: Driver Not Loaded")
    broken = FakeNvml(h100s(2).devices, fail_at=1)
    assert gpus.discover(broken).devices == () and broken.shut_down
    assert gpus.discover(FakeNvml([])).note == "NVML reports no GPUs"


def test_a_mixed_host_offers_the_first_model_only() -> None:
    nvml = FakeNvml([("GPU-a", "NVIDIA L4", GIB), ("GPU-b", "NVIDIA A100-SXM4-80GB", GIB),
                     ("GPU-c", "NVIDIA L4", GIB)])
    found = gpus.discover(nvml)
    assert (found.variant, [d.uuid for d in found.devices]) == ("l4", ["GPU-a", "GPU-c"])


def test_the_workers_own_cuda_visible_devices_restricts_what_it_offers() -> None:
    found = gpus.discover(h100s(4))
    assert [d.index for d in gpus.restrict(found, "1,GPU-00000003").devices] == [1, 3]
    assert gpus.restrict(found, None) == found
    assert gpus.restrict(found, "").devices == ()


def test_discovered_gpus_are_offered_without_a_flag() -> None:
    args = parse_args(["--id", "w", "--cpu", "8"], nvml=h100s(2))
    assert args.resources.device == GpuDevice(variant="h100", count=2)
    assert [d.uuid for d in args.devices] == ["GPU-00000000", "GPU-00000001"]


def test_the_gpu_flag_without_nvml_numbers_devices_unchecked() -> None:
    args = parse_args(["--id", "w", "--gpu", "h100:2"], nvml=FakeNvml([], fail_init=True))
    assert args.resources.device == GpuDevice(variant="h100", count=2)
    assert args.devices == (DeviceInfo(index=0), DeviceInfo(index=1))
    assert parse_args(["--id", "w"], nvml=None).devices == ()


def test_the_gpu_flag_may_offer_fewer_than_found_but_not_more(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert len(parse_args(["--gpu", "h100:1"], nvml=h100s(2)).devices) == 1
    for flag, why in (("h100:3", "asks for 3 GPUs, NVML found 2 (NVIDIA H100 80GB HBM3)"),
                      ("a100:1", "NVML found h100 GPUs (NVIDIA H100 80GB HBM3), not a100"),
                      ("h100:0", "COUNT must be at least 1")):
        with pytest.raises(SystemExit):
            parse_args(["--gpu", flag], nvml=h100s(2))
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith(f"--gpu {flag}: {why}"), err
        assert "Traceback" not in err


def test_a_task_sees_exactly_its_gpus_and_none_if_it_asked_for_none() -> None:
    gpu = Resources(device=GpuDevice(variant="h100", count=2))
    cpu = Resources()
    worker_env = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    spec_env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # a spec cannot widen its share either
    env = task_environment(worker_env, spec_env, "w", gpu_devices(gpu, ["GPU-a", "GPU-b"]))
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert task_environment(worker_env, spec_env, "w",
                            gpu_devices(cpu, []))["CUDA_VISIBLE_DEVICES"] == ""
    tpu = Resources(device=TpuDevice(variant="v5p", count=4))
    assert gpu_devices(tpu, ["0"]) == ""
    # A run command from a scheduler that predates pinning names no devices: left unset.
    assert "CUDA_VISIBLE_DEVICES" not in task_environment(worker_env, {}, "w",
                                                          gpu_devices(gpu, None))


def test_gang_members_get_torch_and_jax_variables_from_their_ranks() -> None:
    gang = JobSpec(name="g", command=["x"], replicas=4, ports=["coord"],
                   coscheduling=Coscheduling(group_by="rack"))
    env = frameworks.variables(gang, 2, "10.0.0.7", {"coord": 30001}, "10.0.0.5:30000")
    assert env == {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "30000", "WORLD_SIZE": "4",
                   "RANK": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "JAX_COORDINATOR_ADDRESS": "10.0.0.5:30000", "JAX_NUM_PROCESSES": "4",
                   "JAX_PROCESS_ID": "2"}
    single = JobSpec(name="s", command=["x"], replicas=3, ports=["coord"])
    env = frameworks.variables(single, 1, "10.0.0.7", {"coord": 30002}, "")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"], env["RANK"]) == (
        "10.0.0.7", "30002", "1", "0")
    no_port = frameworks.variables(JobSpec(name="n", command=["x"]), 0, "h", {}, "")
    assert "MASTER_ADDR" not in no_port and no_port["WORLD_SIZE"] == "1"


def test_the_example_specs_are_valid_gpu_jobs() -> None:
    for name in ("torch_ddp.yaml", "jax_distributed.yaml"):
        spec = msgspec.json.decode(load_spec(str(ROOT / "examples" / name)), type=JobSpec)
        assert spec.resources.device == GpuDevice(variant="h100", count=1)
        assert spec.coscheduling is not None and spec.ports


def test_the_gpu_check_script_loads_and_explains_itself() -> None:
    """bench/gpu_check.py runs on a GPU host only (`--quick` here takes half a minute): at
    least it must load, with every check it names."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["gpu_check"]
    for name in ("a_discovered", "b_one_gpu", "c_no_gpu", "d_waits", "e_peak_memory",
                 "f_torch_gang", "g_jax_gang", "doctor"):
        assert callable(getattr(module.Check, name))
    assert module.task_python(None, quick=True) == (sys.executable, False, False)


def test_a_lost_gpu_or_uncorrectable_ecc_errors_make_a_device_unhealthy() -> None:
    nvml = h100s(4)
    devices = (*gpus.discover(nvml).devices, DeviceInfo(index=9))  # unchecked: skipped
    assert gpu_health.unhealthy(nvml, devices) == {}
    nvml.lost = ("GPU-00000001",)
    nvml.ecc = {2: 3, 3: None}  # device 3 has no ECC to read: judged by nothing
    bad = gpu_health.unhealthy(nvml, devices)
    assert bad == {1: "NVML cannot reach GPU-00000001: GPU is lost",
                   2: "3 uncorrectable ECC errors"}
    assert gpu_health.new_problems({}, bad) == sorted(bad.items())
    assert gpu_health.new_problems(dict(bad), bad) == []  # reported once per reason
    assert gpu_health.new_problems(bad, {}) == []  # never reported healthy by the worker


def test_berth_status_and_workers_show_the_devices() -> None:
    from berth.cli_views import format_attempt as _format_attempt
    from berth.cli_views import format_worker as _format_worker

    attempt = {"attempt_id": 0, "worker_id": "gpu0", "state": "running",
               "worker_failure": False, "exit_code": None, "error": "", "devices": [2, 3],
               "assigned_at": 1.0, "started_at": None, "finished_at": None,
               "gpu": {"peak_memory_mb": 10610, "mean_utilization": 61.5,
                       "peak_utilization": 99, "samples": 12}}
    assert ("running, devices 2,3, GPU memory peak 10610 MiB, utilisation mean 62% peak 99%"
            in _format_attempt(attempt))
    worker = {"worker_id": "gpu0", "healthy": True, "running_attempts": ["j1-aaaa/0/0"],
              "cpu_free": 7, "devices_free": 1,
              "resources": {"cpu": 8, "memory_mb": 1024,
                            "device": {"type": "gpu", "variant": "h100", "count": 2}},
              "devices": [{"index": 0, "uuid": "GPU-a", "model": "NVIDIA H100 80GB HBM3",
                           "memory_mb": 81559, "held_by": "j1-aaaa/0/0", "unhealthy": None},
                          {"index": 1, "uuid": "GPU-b", "model": "NVIDIA H100 80GB HBM3",
                           "memory_mb": 81559, "held_by": None,
                           "unhealthy": "3 uncorrectable ECC errors"}]}
    assert _format_worker(worker) == [
        "gpu0             healthy   8 cpu, 1024 MiB, 2 gpu:h100  (1 running, 7 cpu free, "
        "1 devices free)",
        "  device 0: GPU-a NVIDIA H100 80GB HBM3 81559 MiB  held by j1-aaaa/0/0",
        "  device 1: GPU-b NVIDIA H100 80GB HBM3 81559 MiB  free, UNHEALTHY: 3 uncorrectable "
        "ECC errors"]


def test_an_attempts_gpu_memory_peak_and_utilisation_come_from_its_own_processes() -> None:
    """Two attempts on a 2-GPU worker: supervisors 100 and 200; 101 (child of 100) uses
    device 0, 202 (grandchild of 200, via 201) uses device 1, 999 is not berth's."""
    nvml = h100s(2)
    parents = {101: 100, 202: 201, 201: 200, 999: 1}
    sampler = gpu_telemetry.Sampler(nvml, gpus.discover(nvml).devices, parents.get)
    roots = {100: "a/0/0", 200: "b/0/0"}
    nvml.procs = {0: [(101, 10 * GIB), (999, 70 * GIB)], 1: [(202, 2 * GIB)]}
    nvml.util = {0: [(101, 5, 90), (999, 6, 100)], 1: [(202, 5, 40)]}
    sampler.sample(roots)
    nvml.procs = {0: [(101, 4 * GIB)], 1: [(202, None)]}  # NVML cannot tell: not counted
    nvml.util = {0: [(101, 5, 90), (101, 9, 30)], 1: []}  # only samples newer than seen
    sampler.sample(roots)
    assert sampler.finish("a/0/0") == GpuTelemetry(peak_memory_mb=10240, mean_utilization=60.0,
                                                   peak_utilization=90, samples=2)
    assert sampler.finish("b/0/0") == GpuTelemetry(peak_memory_mb=2048, mean_utilization=40.0,
                                                   peak_utilization=40, samples=1)
    assert sampler.finish("a/0/0") is None
    assert gpu_telemetry.owner(999, roots, parents.get) is None
    assert gpu_telemetry.parent_of(os.getpid()) == os.getppid()


def test_each_devices_figures_go_with_the_heartbeat_and_show_on_the_worker() -> None:
    from berth.services.dashboard_api.views import worker_out
    from berth.shared.lifecycle import ClusterState
    from berth.shared.messages import DeviceStats, WorkerRegistered

    nvml = h100s(3)
    nvml.lost = ("GPU-00000001",)
    found = gpus.discover(nvml).devices
    stats = gpu_telemetry.device_stats(nvml, (*found, DeviceInfo(index=7)))
    assert stats == [
        DeviceStats(index=0, utilization=0, memory_used_mb=0, temperature_c=40),
        DeviceStats(index=1),  # NVML cannot reach it: nothing known
        DeviceStats(index=2, utilization=100, memory_used_mb=6144, temperature_c=None)]
    state = ClusterState()
    state.apply(1, WorkerRegistered(worker_id="g", incarnation="i", devices=list(found),
                                    resources=Resources(device=GpuDevice(variant="h100",
                                                                         count=3))))
    out = worker_out(state.workers["g"], 1.0, True, stats)
    assert [(d.index, d.utilization, d.memory_used_mb) for d in out.devices] == [
        (0, 0, 0), (1, None, None), (2, 100, 6144)]


def test_card_xid_errors_make_a_device_unhealthy_but_a_programs_own_do_not() -> None:
    nvml = h100s(3)
    watch = gpu_health.XidWatch(nvml, gpus.discover(nvml).devices)
    assert nvml.registered == [0, 1, 2]
    assert watch.drain() == {}
    nvml.xids = [(0, 13), (1, 79), (2, 31), (2, 48)]  # 13, 31: the program's fault
    assert watch.drain() == {1: "Xid 79", 2: "Xid 48"}
    assert nvml.xids == [] and watch.drain() == {}
    watch.close()
    assert nvml.registered == []


async def test_the_watch_reports_an_unhealthy_device_once_and_keeps_the_figures() -> None:
    from berth.services.worker_agent.gpu_watch import GpuWatch

    nvml = h100s(2)
    watch = GpuWatch(nvml, gpus.discover(nvml).devices)
    nvml.lost = ("GPU-00000001",)
    reports: list[tuple[int, str]] = []

    async def report(index: int, why: str) -> None:
        reports.append((index, why))

    task = asyncio.create_task(watch.run(lambda: {}, report))
    for _ in range(500):
        if reports:
            break
        await asyncio.sleep(0.01)
    assert watch.sampler is not None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert reports == [(1, "NVML cannot reach GPU-00000001: GPU is lost")]
    assert [(s.index, s.temperature_c) for s in watch.stats] == [(0, 40), (1, None)]
    assert watch.sampler is None and watch.finish("a/0/0") is None
