"""Issue 20's checks on a real GPU host: berth's GPUs discovered, pinned and isolated.

Starts the embedded stack (NATS, valkey, the four services) in a temporary directory with
two workers on this host, both with `-a rack=r1`: `gpu0` discovers the GPUs through NVML
(no --gpu flag), `cpu1` is given none (its CUDA_VISIBLE_DEVICES is ""), so a two-task gang
can span them. Then, each check printing PASS, FAIL, SKIP or NOT BUILT with what it saw:

  (a) gpu0 discovered its GPU through NVML: its variant, UUID and memory
  (b) a one-GPU PyTorch job sees exactly that device (CUDA_VISIBLE_DEVICES is its UUID,
      torch.cuda.device_count() == 1, the same UUID)
  (c) a job that asked for no GPU sees none (torch.cuda.device_count() == 0)
  (d) with every GPU held, a second one-GPU job waits (its pending reason names the GPUs)
      and starts only after the first ends
  (e) a job allocating 10 GiB reports its peak GPU memory within 10 % (the worker samples
      its processes through NVML every second and sends the figures with the exit report)
  (f) a two-task gang initialises torch.distributed from berth's variables alone and
      all-reduces a tensor (gloo, since one host with one GPU has no GPU for each rank)
  (g) two JAX processes of a gang initialise jax.distributed from berth's variables (SKIP
      where JAX is not installed)
  (h) gpu0's heartbeats carry each GPU's utilisation, memory in use and temperature (NVML),
      shown by the API and as the dashboard's Prometheus gauges

Then `berth doctor`'s checker must find no device, port or host double-booked.

It needs only this repository and its installed dependencies (no package registry):

    python bench/gpu_check.py                  # on the GPU host
    python bench/gpu_check.py --python /path/to/python-with-torch
    python bench/gpu_check.py --quick          # anywhere (CI): no NVML, `--gpu h100:1`,
                                               # probes read the environment, not torch

Exit status 0 when no check FAILED. Paste the printed block into docs/gpus.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from berth.client import ApiError, api_get, submit_job
from berth.shared import nats_io, redis_auth, redis_io
from berth.shared.checker import check_cluster
from berth.shared.messages import Coscheduling, GpuDevice, JobSpec, Resources
from berth.shared.reservations import ReservationStore
from berth.spec_files import load_spec
from berth.stack import Stack, start_stack

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT = 120.0
ENDED = {"succeeded", "failed", "killed", "unschedulable"}

# What a task sees, written as JSON to argv[1]; with torch (argv[2] == "torch") also what
# CUDA reports. Holds until the file argv[3] exists, when given.
PROBE = r"""
import json, os, sys, time
seen = {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}
if sys.argv[2] == "torch":
    import torch
    n = torch.cuda.device_count()
    seen["count"] = n
    seen["names"] = [torch.cuda.get_device_name(i) for i in range(n)]
    seen["uuids"] = [str(getattr(torch.cuda.get_device_properties(i), "uuid", ""))
                     for i in range(n)]
open(sys.argv[1], "w").write(json.dumps(seen))
while len(sys.argv) > 3 and not os.path.exists(sys.argv[3]):
    time.sleep(0.05)
"""

# Holds 10 GiB on its GPU for a few samples (the worker samples every second).
ALLOCATE_10_GIB = r"""
import time, torch
x = torch.empty(10 * 2**30, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
time.sleep(4)
print("held", x.numel() // 2**20, "MiB")
"""

JAX_PROBE = r"""
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                           process_id=int(os.environ["JAX_PROCESS_ID"]))
print("jax processes", jax.process_count(), "this one", jax.process_index())
assert jax.process_count() == int(os.environ["JAX_NUM_PROCESSES"])
"""


@dataclass
class Result:
    name: str
    verdict: str  # PASS, FAIL, SKIP, NOT BUILT
    detail: str


class Check:
    def __init__(self, stack: Stack, nc: Any, out: Path, python: str, torch: bool,
                 jax: bool) -> None:
        self.stack = stack
        self.nc = nc
        self.out = out
        self.python = python
        self.torch = torch
        self.jax = jax
        self.results: list[Result] = []

    def say(self, name: str, verdict: str, detail: str) -> None:
        self.results.append(Result(name, verdict, detail))
        print(f"{verdict:<9} {name}: {detail}", flush=True)

    async def run(self, name: str, check: Callable[[], Awaitable[tuple[str, str]]]) -> None:
        try:
            verdict, detail = await check()
        except Exception as exc:
            verdict, detail = "FAIL", f"{type(exc).__name__}: {exc}"
        self.say(name, verdict, detail)

    # --- helpers ----------------------------------------------------------------------

    def api(self, path: str) -> Any:
        return api_get(self.stack.api_url, path)

    def probe(self, name: str, hold: str = "") -> tuple[str, ...]:
        mode = "torch" if self.torch else "env"
        return (self.python, "-c", PROBE, str(self.out / f"{name}.json"), mode,
                *([str(self.out / hold)] if hold else []))

    def seen(self, name: str) -> dict[str, Any] | None:
        path = self.out / f"{name}.json"
        if not path.exists():
            return None
        try:
            found: dict[str, Any] = json.loads(path.read_text())
        except ValueError:
            return None  # being written
        return found

    async def submit(self, spec: JobSpec) -> str:
        outcome = await submit_job(self.nc, spec)
        if not outcome.accepted:
            raise RuntimeError(f"submit refused: {outcome.reason}")
        return str(outcome.job_id)

    async def until(self, what: str, predicate: Callable[[], Any],
                    timeout: float = JOB_TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            await asyncio.sleep(0.1)
        raise TimeoutError(f"no {what} after {timeout:g} s")

    def job(self, job_id: str) -> dict[str, Any] | None:
        """The job as the API shows it; None while the dashboard has not folded it yet."""
        try:
            job: dict[str, Any] = self.api(f"/api/jobs/{job_id}")
        except ApiError as exc:
            if "404" in str(exc):
                return None
            raise
        return job

    async def ended(self, job_id: str) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job is not None and job["state"] in ENDED else None

        job: dict[str, Any] = await self.until(f"end of {job_id}", done)
        if job["state"] != "succeeded":
            raise RuntimeError(f"job {job_id} {job['state']}: {job.get('error')}; "
                               f"logs: {self.logs(job_id)}")
        return job

    def logs(self, job_id: str, index: int = 0) -> str:
        try:
            raw = self.api_text(f"/api/jobs/{job_id}/tasks/{index}/logs")
        except Exception as exc:
            return f"(no logs: {exc})"
        return raw[-600:]

    def api_text(self, path: str) -> str:
        from berth.client import api_fetch
        return api_fetch(self.stack.api_url, path).decode(errors="replace")

    def gpu_worker(self) -> dict[str, Any]:
        workers: list[dict[str, Any]] = self.api("/api/workers")
        return next(w for w in workers if w["worker_id"] == "gpu0")

    # --- the checks -------------------------------------------------------------------

    async def a_discovered(self, quick: bool) -> tuple[str, str]:
        w = self.gpu_worker()
        device = w["resources"]["device"]
        if device["type"] != "gpu":
            return "FAIL", f"gpu0 offers {device}; devices {w['devices']}"
        first = w["devices"][0]
        what = (f"{device['count']} x {device['variant']}: index {first['index']}, uuid "
                f"{first['uuid'] or '-'}, {first['model'] or 'model unknown'}, "
                f"{first['memory_mb']} MiB")
        if quick:
            return "SKIP", f"--quick: no NVML, offered by --gpu ({what})"
        ok = first["uuid"].startswith("GPU-") and first["memory_mb"] > 0 and first["model"]
        return ("PASS" if ok else "FAIL"), what

    def one_gpu(self) -> Resources:
        variant = self.gpu_worker()["resources"]["device"]["variant"]
        return Resources(cpu=1, memory_mb=2048, device=GpuDevice(variant=variant, count=1))

    async def b_one_gpu(self) -> tuple[str, str]:
        w = self.gpu_worker()
        job_id = await self.submit(JobSpec(name="b-one-gpu", command=self.probe("b"),
                                           resources=self.one_gpu()))
        job = await self.ended(job_id)
        seen = self.seen("b") or {}
        held = job["tasks"][0]["attempts"][-1]["devices"]
        expected = ",".join(d["uuid"] or str(d["index"]) for d in w["devices"]
                            if d["index"] in held)
        problems = []
        if seen.get("cvd") != expected:
            problems.append(f"CUDA_VISIBLE_DEVICES {seen.get('cvd')!r} != {expected!r}")
        if self.torch:
            if seen.get("count") != 1:
                problems.append(f"torch sees {seen.get('count')} devices")
            uuid = (seen.get("uuids") or [""])[0]
            if uuid and f"GPU-{uuid}".lower() != expected.lower() and uuid != expected:
                problems.append(f"torch's device is {uuid}, not {expected}")
        return ("FAIL" if problems else "PASS"), "; ".join(problems) or (
            f"devices {held}, CUDA_VISIBLE_DEVICES={seen.get('cvd')!r}"
            + (f", torch sees {seen.get('count')}: {seen.get('names')}" if self.torch else ""))

    async def c_no_gpu(self) -> tuple[str, str]:
        job_id = await self.submit(JobSpec(name="c-no-gpu", command=self.probe("c"),
                                           resources=Resources(cpu=1, memory_mb=1024)))
        await self.ended(job_id)
        seen = self.seen("c") or {}
        ok = seen.get("cvd") == "" and (not self.torch or seen.get("count") == 0)
        return ("PASS" if ok else "FAIL"), (
            f"CUDA_VISIBLE_DEVICES={seen.get('cvd')!r}"
            + (f", torch.cuda.device_count() == {seen.get('count')}" if self.torch else ""))

    async def d_waits(self) -> tuple[str, str]:
        count = self.gpu_worker()["resources"]["device"]["count"]
        holders = [await self.submit(JobSpec(
            name=f"d-hold-{i}", command=self.probe(f"d-hold-{i}", "d-go"),
            resources=self.one_gpu())) for i in range(count)]
        await self.until("every GPU held",
                         lambda: all(self.seen(f"d-hold-{i}") for i in range(count)))
        second = await self.submit(JobSpec(name="d-second", command=self.probe("d-second"),
                                           resources=self.one_gpu()))
        reason = await self.until("a pending reason", lambda: (
            self.job(second) or {"tasks": [{}]})["tasks"][0].get("pending_reason"), 30)
        await asyncio.sleep(1.0)  # it must still be waiting
        if self.seen("d-second") is not None:
            return "FAIL", "the second job ran while every GPU was held"
        (self.out / "d-go").write_text("")
        ends = [(await self.ended(h))["tasks"][0]["attempts"][-1]["finished_at"]
                for h in holders]
        job = await self.ended(second)
        started = job["tasks"][0]["attempts"][-1]["started_at"]
        ok = started >= min(ends) and "GPU" in reason
        return ("PASS" if ok else "FAIL"), (f"waited with {reason!r}; started "
                                            f"{started - min(ends):+.2f} s after a GPU freed")

    async def e_peak_memory(self) -> tuple[str, str]:
        if not self.torch:
            return "SKIP", "PyTorch is not installed for the task's python"
        job = await self.ended(await self.submit(JobSpec(
            name="e-10gib", command=(self.python, "-c", ALLOCATE_10_GIB),
            resources=self.one_gpu())))
        gpu = job["tasks"][0]["attempts"][-1].get("gpu")
        if not gpu:
            return "FAIL", "no GPU figures in the exit report"
        off = gpu["peak_memory_mb"] / 10240 - 1
        verdict = "PASS" if abs(off) <= 0.10 else "FAIL"
        return verdict, (f"peak {gpu['peak_memory_mb']} MiB for 10240 allocated ({off:+.1%}), "
                         f"utilisation mean {gpu['mean_utilization']} peak "
                         f"{gpu['peak_utilization']} over {gpu['samples']} samples")

    def gang_spec(self, name: str, command: tuple[str, ...], env: dict[str, str]) -> JobSpec:
        return JobSpec(name=name, replicas=2, command=command, env=env, ports=("rendezvous",),
                       coscheduling=Coscheduling(group_by="rack"),
                       resources=Resources(cpu=1, memory_mb=2048))

    async def f_torch_gang(self) -> tuple[str, str]:
        if not self.torch:
            return "SKIP", "PyTorch is not installed for the task's python"
        example = msgspec.json.decode(load_spec(str(ROOT / "examples" / "torch_ddp.yaml")),
                                      type=JobSpec)
        spec = self.gang_spec("f-torch-gang", (self.python, *example.command[1:]),
                              {"BACKEND": "gloo"})
        job = await self.ended(await self.submit(spec))
        out = " | ".join(self.logs(job["job_id"], i).strip() for i in (0, 1))
        return "PASS", f"examples/torch_ddp.yaml as a 2-task gang on gloo: {out}"

    async def g_jax_gang(self) -> tuple[str, str]:
        if not self.jax:
            return "SKIP", "JAX is not installed for the task's python"
        job = await self.ended(await self.submit(self.gang_spec(
            "g-jax-gang", (self.python, "-c", JAX_PROBE), {"JAX_PLATFORMS": "cpu"})))
        return "PASS", " | ".join(self.logs(job["job_id"], i).strip() for i in (0, 1))

    async def h_device_figures(self, quick: bool) -> tuple[str, str]:
        if quick:
            return "SKIP", "--quick: no NVML, so no figures to send"

        def reported() -> dict[str, Any] | None:
            first: dict[str, Any] = self.gpu_worker()["devices"][0]
            figures = ("utilization", "memory_used_mb", "temperature_c")
            return first if all(first.get(f) is not None for f in figures) else None

        first = await self.until("device figures in a heartbeat", reported, 30)
        gauges = [line for line in self.api_text("/metrics").splitlines()
                  if line.startswith("berth_gpu_") and 'worker="gpu0"' in line]
        names = {line.split("{")[0] for line in gauges}
        wanted = {"berth_gpu_utilization_percent", "berth_gpu_memory_used_bytes",
                  "berth_gpu_temperature_celsius"}
        detail = (f"device 0: {first['utilization']}% busy, {first['memory_used_mb']} MiB "
                  f"used, {first['temperature_c']} C; dashboard gauges: {', '.join(gauges)}")
        return ("PASS" if names >= wanted else "FAIL"), detail

    async def doctor(self) -> tuple[str, str]:
        client = redis_io.connect(self.stack.redis.url_for(redis_auth.DOCTOR))
        try:
            report = await check_cluster(self.nc.jetstream(), ReservationStore(client))
        finally:
            await client.aclose()
        line = (f"double_booked_devices={report.double_booked_devices} "
                f"double_booked_ports={report.double_booked_ports} "
                f"double_booked_hosts={report.double_booked_hosts} "
                f"violations={len(report.violations())}")
        return ("PASS" if report.ok else "FAIL"), line


def imports(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                          timeout=300).returncode == 0


def task_python(requested: str | None, quick: bool) -> tuple[str, bool, bool]:
    """The python tasks run, and whether it has PyTorch and JAX (--quick: neither used)."""
    if requested:
        candidates = [requested]
    else:
        candidates = [sys.executable] + [p for p in (shutil.which("python3"),) if p]
    if quick:
        return candidates[0], False, False
    python = next((p for p in candidates if imports(p, "torch")), candidates[0])
    return python, imports(python, "torch"), imports(python, "jax")


async def main_async(args: argparse.Namespace) -> int:
    python, torch, jax = task_python(args.python, args.quick)
    with tempfile.TemporaryDirectory(prefix="berth-gpu-check-") as tmp:
        data = Path(tmp) / "berth"
        out = Path(tmp) / "seen"
        out.mkdir()
        stack = start_stack(data, workers=0, extra_env={"BERTH_PENDING_REASON_INTERVAL": "0.2"})
        try:
            gpu_flags = ["--gpu", "h100:1"] if args.quick else []
            stack.start_worker("gpu0", args.cpu, args.memory_mb, "-a", "rack=r1", *gpu_flags)
            stack.start_worker("cpu1", args.cpu, args.memory_mb, "-a", "rack=r1",
                               env={"CUDA_VISIBLE_DEVICES": ""})
            nc = await nats_io.connect(stack.nats.url, "berth-gpu-check",
                                       stack.nats.admin_creds())
            check = Check(stack, nc, out, python, torch, jax)
            try:
                await check.until("both workers", lambda: {
                    w["worker_id"] for w in check.api("/api/workers") if w["healthy"]}
                    >= {"gpu0", "cpu1"}, 60)
                print(f"# berth GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                      f", host {platform.node()}, tasks run {python}"
                      f" ({'with' if torch else 'without'} PyTorch)"
                      f"{', --quick' if args.quick else ''}", flush=True)
                await check.run("(a) discovery", lambda: check.a_discovered(args.quick))
                await check.run("(b) one-GPU job sees exactly its device", check.b_one_gpu)
                await check.run("(c) no-GPU job sees none", check.c_no_gpu)
                await check.run("(d) a one-GPU job waits for a free GPU", check.d_waits)
                await check.run("(e) peak GPU memory reported", check.e_peak_memory)
                await check.run("(f) torch.distributed gang from berth's variables",
                                check.f_torch_gang)
                await check.run("(g) jax.distributed gang from berth's variables",
                                check.g_jax_gang)
                await check.run("(h) device figures in heartbeats",
                                lambda: check.h_device_figures(args.quick))
                await check.run("doctor", check.doctor)
            finally:
                await nats_io.close(nc)
        finally:
            stack.stop()
    failed = [r.name for r in check.results if r.verdict == "FAIL"]
    print(f"{len(failed)} failed: {', '.join(failed)}" if failed else "no check failed")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="no NVML needed: the GPU worker offers --gpu h100:1 and the "
                        "probes read only the environment (what CI runs)")
    parser.add_argument("--python", help="the python tasks run (default: this one, else "
                        "python3 on PATH, whichever has PyTorch)")
    parser.add_argument("--cpu", type=float, default=4, help="cpu offered by each worker")
    parser.add_argument("--memory-mb", type=int, default=16384,
                        help="memory offered by each worker, MiB")
    args = parser.parse_args()
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()

