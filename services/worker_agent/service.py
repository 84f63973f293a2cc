"""The worker agent process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import random
import signal
import socket
import time
import uuid
from collections.abc import Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry.context import Context

from berth.services.worker_agent import (
    build,
    device_offer,
    gpus,
    metrics,
    pid_journal,
    simulation,
    task_dirs,
    tpus,
)
from berth.services.worker_agent.bundle_cache import BundleCache, BundleUnavailable
from berth.services.worker_agent.epochs import EpochView
from berth.services.worker_agent.gpu_watch import GpuWatch
from berth.services.worker_agent.pid_journal import PidJournal
from berth.services.worker_agent.process import (
    AttemptProcess,
    Runnable,
    describe_exit,
    signal_group,
)
from berth.services.worker_agent.report_sender import ReportSender
from berth.services.worker_agent.task_dirs import TaskDirs
from berth.services.worker_agent.task_env import gpu_devices, inherited, task_environment
from berth.services.worker_agent.zygote import Zygote
from berth.shared import bounded, dir_lock, nats_io, service, subjects, telemetry
from berth.shared import metrics as shared_metrics
from berth.shared.config import Settings
from berth.shared.credentials import Role
from berth.shared.messages import (
    AnyCommand,
    AttemptReported,
    DeviceHealthChanged,
    DeviceInfo,
    GpuDevice,
    Heartbeat,
    HeartbeatAck,
    KillAttempt,
    LeaderAnnouncement,
    ResetWorker,
    Resources,
    ResourceUse,
    RunAttempt,
    TpuDevice,
    WorkerRegistered,
    WorkerStopped,
    attempt_key,
    command_decoder,
    decode,
    encode,
    heartbeat_ack_decoder,
    leader_decoder,
)
from berth.shared.states import TaskState

log = logging.getLogger("berth.worker")
tracer = telemetry.tracer("berth.worker")
MAX_REMEMBERED_ATTEMPTS = 10000
FINAL_REPORTS = (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.KILLED)


@dataclass
class RunningAttempt:
    command: RunAttempt
    process: Runnable | None = None
    kill_reason: str = ""
    kill_grace: float | None = None  # the kill command's grace, if it gave one
    timed_out: bool = False
    task: asyncio.Task[None] | None = None
    killed: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerAgent:
    def __init__(
        self,
        settings: Settings,
        nc: NATS,
        worker_id: str,
        resources: Resources,
        attributes: dict[str, str],
        address: str = "",
        simulate: Callable[[], Runnable] | None = None,
        reports: nats_io.EventPublisher | None = None,
        devices: tuple[DeviceInfo, ...] = (),
        nvml: gpus.Nvml | None = None,
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        # Simulated hosts share one publisher, so their messages share its acks; each host
        # coalesces its own reports (report_sender.py): a batch names one worker only.
        self.reports = reports or nats_io.EventPublisher(self.js)
        self.worker_id = worker_id
        self.report_sender = ReportSender(
            worker_id, subjects.attempt_reports(worker_id), settings.report_coalesce,
            self.reports.submit,
            lambda subject, event, msg_id, done: self.reports.submit(subject, event, msg_id,
                                                                     done=done))
        self.incarnation = uuid.uuid4().hex[:12]
        self.resources = resources
        self.attributes = attributes
        self.devices = devices
        # Watches the discovered GPUs (use, health); None where there are none.
        self.gpu_watch = (GpuWatch(nvml, devices)
                          if nvml is not None and any(d.uuid for d in devices) else None)
        self.address = address or _default_address()
        self.epochs = EpochView()
        # A heartbeat sent out of turn to check a claimed epoch; its claimants await it.
        self.epoch_check: asyncio.Task[None] | None = None
        self.hb_cursor = ""  # where the next heartbeat's window of attempts starts
        self.running: dict[str, RunningAttempt] = {}
        # Attempts this incarnation has started, so a re-sent assignment never runs twice.
        self.seen: dict[str, None] = {}
        # Set while shutting down or resetting: no new attempt starts, and the exits of the
        # attempts being stopped are not reported (WorkerStopped, or the scheduler's
        # WorkerDeclaredDead, already accounts for every one of them).
        self.winding_down = False
        self.refused_commands = 0
        self.reported_seq = 0  # see Heartbeat.reported_seq
        self.background: set[asyncio.Task[None]] = set()
        # Simulated hosts (--simulate): each attempt is a SimulatedProcess, not a process.
        self.simulate = simulate
        self.home = Path(settings.data_dir) / "workers" / worker_id
        # The process groups of this worker's attempts (pid_journal.py); `pids/` held a file
        # per attempt before, and is read once for what an older agent left.
        self.pid_journal = PidJournal(self.home / "attempt-groups")
        self.pid_dir = self.home / "pids"
        # Forks each attempt's supervisor (services/worker_agent/zygote.py).
        self.zygote = Zygote()
        # The agent's own environment, as far as its tasks see it (task_env.py).
        self.inherited_env = inherited(os.environ)
        self.bundles = BundleCache(self.home / "bundles", settings.bundle_cache_bytes, self.js,
                                   copies=settings.bundle_copies)
        # At most this many attempts in BUILDING at once; the others wait ASSIGNED.
        self.builds = asyncio.Semaphore(settings.max_builds)
        # Until when (CLOCK_MONOTONIC) this incarnation's tasks may run: moved later each
        # time the leader acknowledges a heartbeat, or a new leader is announced. Every
        # task's supervisor kills the task at this deadline unless it is renewed, so a
        # paused or cut-off agent's tasks are gone before the scheduler may declare it dead.
        self.fence_deadline = time.monotonic() + settings.fence_after
        # As the leader asks (Settings.heartbeat_interval_asked): slower in a large cluster.
        self.heartbeat_interval = settings.heartbeat_interval

    # --- life -------------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event, follow_leader: bool = True,
                    first_heartbeat_after: float = 0.0) -> None:
        """Runs until `stop`. Hosts sharing a process may leave `follow_leader` to one
        subscription that calls `on_leader` for all of them."""
        if self.simulate is None:
            self._kill_orphans()
            if moved := task_dirs.move_old_layout(self.home):
                log.info("moved %d task directories to tasks/<job>.<task>/", moved)
            self.bundles.tidy()
            self._spawn(self._collect_task_dirs(stop))
            # A supervisor per CPU offered, forked before any task comes (zygote.py).
            self.zygote.warm(math.ceil(self.resources.cpu))
        commands = subjects.worker_commands(self.worker_id)
        cmd_sub = (await nats_io.subscribe_now(self.nc, commands, self._on_simulated_command)
                   if self.simulate is not None
                   else await self.nc.subscribe(commands, cb=self._on_command))
        leader_sub = (await self.nc.subscribe(subjects.LEADER, cb=self._on_leader)
                      if follow_leader else None)
        await self._register()
        watch = (asyncio.create_task(self.gpu_watch.run(self._gpu_roots, self._report_device))
                 if self.gpu_watch is not None else None)
        await service.wait_or_stop(stop, first_heartbeat_after)
        while not stop.is_set():
            await self._heartbeat()
            await service.wait_or_stop(stop, self.heartbeat_interval)
        await cmd_sub.unsubscribe()
        if leader_sub is not None:
            await leader_sub.unsubscribe()
        if watch is not None:
            watch.cancel()
        await self._shutdown()

    async def _register(self) -> None:
        # The leader starts this incarnation's heartbeat clock no earlier than it learns of
        # it, so its tasks may run until this long after the registration was sent.
        sent = time.monotonic()
        await nats_io.publish_event(
            self.js,
            subjects.worker_events(self.worker_id),
            WorkerRegistered(
                worker_id=self.worker_id, incarnation=self.incarnation, resources=self.resources,
                attributes=self.attributes, host=socket.gethostname(), address=self.address,
                devices=list(self.devices), ts=time.time(),
            ),
            msg_id=f"register:{self.worker_id}:{self.incarnation}",
        )
        self.fence_deadline = max(self.fence_deadline, sent + self.settings.fence_after)
        log.info("worker %s (incarnation %s) registered: %g cpu, %d MiB, %s",
                 self.worker_id, self.incarnation, self.resources.cpu, self.resources.memory_mb,
                 tpus.describe(self.devices) if isinstance(self.resources.device, TpuDevice)
                 else gpus.describe(self.devices))

    def _gpu_roots(self) -> dict[int, str]:
        """Supervisor pid -> attempt key of the running attempts that have GPUs."""
        return {a.process.pid: key for key, a in self.running.items()
                if a.process is not None and a.process.pid is not None
                and isinstance(a.command.resources.device, GpuDevice)}

    async def _report_device(self, index: int, why: str) -> None:
        await nats_io.publish_event(
            self.js, subjects.worker_events(self.worker_id),
            DeviceHealthChanged(worker_id=self.worker_id, index=index, healthy=False,
                                reason=why, ts=time.time()),
            msg_id=f"device:{self.worker_id}:{index}:{time.time_ns()}")

    async def _stop_everything(self, reason: str) -> None:
        self.winding_down = True
        if self.running:
            log.info("stopping %d running attempts: %s", len(self.running), reason)
        for attempt in self.running.values():
            attempt.kill_reason = attempt.kill_reason or reason
        await asyncio.gather(*(self._stop_attempt(a) for a in list(self.running.values())))
        tasks = [a.task for a in self.running.values() if a.task]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _reset(self, reason: str) -> None:
        """The scheduler declared this incarnation dead, or the fence ended its tasks: stop
        what it ran and come back as a new incarnation, so nothing the old one did is
        mistaken for the new one's (its registration writes the old attempts off)."""
        if self.winding_down:
            return
        log.warning("starting a new incarnation: %s", reason)
        await self._stop_everything("worker reset")
        self.incarnation = uuid.uuid4().hex[:12]
        self.seen.clear()
        self.winding_down = False
        await self._register()

    async def _shutdown(self) -> None:
        await self._stop_everything("worker shutting down")
        self.zygote.close()
        try:
            # Bounded (about 10 s): a stop must not wait on NATS for ever.
            await nats_io.publish_event(
                self.js, subjects.worker_events(self.worker_id),
                WorkerStopped(worker_id=self.worker_id, incarnation=self.incarnation,
                              ts=time.time()),
                msg_id=f"stopped:{self.worker_id}:{self.incarnation}", attempts=5, timeout=1.5,
            )
        except nats_io.RETRIABLE as exc:
            log.warning("could not record this worker's stop (%s); the scheduler will declare "
                        "it dead after BERTH_WORKER_DEAD_AFTER of silence", exc)

    def _kill_orphans(self) -> None:
        """Processes a previous incarnation of this worker left behind are killed: the
        scheduler has already written their attempts off."""
        left = pid_journal.read(self.pid_journal.path)
        old_files = []
        with contextlib.suppress(OSError):
            for pid_file in self.pid_dir.iterdir():
                with contextlib.suppress(ValueError, OSError):
                    left[pid_file.name] = int(pid_file.read_text())
                old_files.append(pid_file)
        for key, pgid in left.items():
            log.warning("killing orphaned process group %d (%s)", pgid, key)
            signal_group(pgid, signal.SIGKILL)
        # Only now that they are killed are they forgotten.
        self.pid_journal.open()
        for pid_file in old_files:
            pid_file.unlink(missing_ok=True)

    async def _collect_task_dirs(self, stop: asyncio.Event) -> None:
        """Removes old task directories (and the oldest above the size cap) now and hourly."""
        while not stop.is_set():
            in_use = {cmd.command.job_id for cmd in self.running.values()}
            removed = await asyncio.to_thread(
                task_dirs.remove_stale, self.home, self.settings.task_dir_max_age,
                self.settings.task_dir_max_bytes, in_use)
            if removed:
                log.info("removed the task directories of %d old jobs", len(removed))
            await service.wait_or_stop(stop, 3600.0)

    async def _heartbeat(self) -> None:
        hb = self._heartbeat_message()
        if self.simulate is not None:  # nothing runs, so nothing to fence: no answer needed
            with contextlib.suppress(Exception):
                await self.nc.publish(subjects.heartbeat(self.worker_id), encode(hb))
            return
        self._spawn(self._acknowledged_heartbeat(encode(hb)))

    async def _acknowledged_heartbeat(self, data: bytes, timeout: float | None = None) -> None:
        """A heartbeat the leader answers once it has heard it; the answer renews the fence
        from when the heartbeat was sent (no later than the leader heard it), and tells
        which epoch leads."""
        sent = time.monotonic()
        try:
            reply = await self.nc.request(subjects.heartbeat(self.worker_id), data,
                                          timeout=timeout or self.settings.fence_after)
        except Exception:  # no leader, a partition, NATS away: the deadline stands
            metrics.HEARTBEATS_UNANSWERED.inc()
            return
        metrics.HEARTBEATS_ACKNOWLEDGED.inc()
        self._extend_fence(sent + self.settings.fence_after)
        try:
            ack: HeartbeatAck = decode(heartbeat_ack_decoder, reply.data)
        except msgspec.DecodeError:
            return  # an answer without an epoch (an older scheduler): the fence only
        self.epochs.answered(ack.epoch, sent)
        self.heartbeat_interval = self.settings.heartbeat_interval_asked(ack.heartbeat_interval)

    async def _check_epoch(self) -> None:
        """A heartbeat out of turn: its answer tells which epoch really leads. One at a
        time, however many unchecked claims arrive, and briefly: a leader answers at once
        (a declared-dead incarnation is never answered, so a long wait would only hold up
        its commands)."""
        if self.simulate is not None:
            return
        if self.epoch_check is None or self.epoch_check.done():
            timeout = min(self.settings.fence_after, max(1.0, self.settings.heartbeat_interval))
            self.epoch_check = asyncio.create_task(self._acknowledged_heartbeat(
                encode(self._heartbeat_message()), timeout))
        await asyncio.shield(self.epoch_check)

    def _heartbeat_message(self) -> Heartbeat:
        hb = heartbeat_of(self.worker_id, self.incarnation, self.running, self.hb_cursor)
        hb.reported_seq = self.reported_seq
        self.hb_cursor = hb.covers_to
        if self.gpu_watch is not None:
            # At most 1,024 small entries: within the room MAX_MESSAGE_BYTES leaves.
            hb.devices = self.gpu_watch.stats
        return hb

    def _extend_fence(self, deadline: float) -> None:
        if deadline <= self.fence_deadline:
            return
        self.fence_deadline = deadline
        for attempt in self.running.values():
            if attempt.process is not None:
                attempt.process.renew(deadline)

    # --- commands ---------------------------------------------------------------------

    async def _on_leader(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            self.on_leader(decode(leader_decoder, msg.data))

    def on_leader(self, ann: LeaderAnnouncement) -> None:
        if self.simulate is None and self.epochs.unchecked(ann.epoch):
            self._spawn(self._check_epoch())
        if self.simulate is not None and ann.epoch >= self.epochs.current:
            # Simulated hosts get no answers: they take the pace from the broadcast.
            self.heartbeat_interval = self.settings.heartbeat_interval_asked(
                ann.heartbeat_interval)
        if self._claimed(ann.epoch):
            # A new leader starts every worker's heartbeat clock after this announcement:
            # no verdict on this worker can come sooner than that, whatever the old one
            # last heard.
            self._extend_fence(time.monotonic() + self.settings.fence_after)

    def _claimed(self, epoch: int) -> bool:
        """A message claims a leader of `epoch`: True if the epoch obeyed rose to it
        (services/worker_agent/epochs.py)."""
        now = time.monotonic()
        if self.simulate is not None:
            # Simulated hosts (a benchmark tool, run as admin) ask for no answers to their
            # heartbeats, so they believe what they hear.
            raised = epoch > self.epochs.current
            self.epochs.answered(max(epoch, self.epochs.current), now)
            return raised
        return self.epochs.claimed(epoch, now)

    async def _on_command(self, msg: Msg) -> None:
        command = self._read_command(msg)
        if command is None or not self._screen(command):
            return
        if self.simulate is None and self.epochs.unchecked(command.epoch):
            # A leader this worker has not confirmed yet (it joined after the announcement,
            # or missed it, and the epoch skipped a number) or a forgery: the leader's
            # answer to a heartbeat says which, before the command is judged.
            await self._check_epoch()
        self._obey(command, msg)

    def _on_simulated_command(self, msg: Msg) -> None:
        """A simulated host's commands, taken in the connection's reading task: it checks
        no epochs (it hears no answers), so nothing waits, and there is no task wake-up
        per command (nats_io.Client.subscribe_now)."""
        command = self._read_command(msg)
        if command is not None and self._screen(command):
            self._obey(command, msg)

    def _read_command(self, msg: Msg) -> AnyCommand | None:
        try:
            command: AnyCommand = decode(command_decoder, msg.data)
        except msgspec.DecodeError as exc:
            log.warning("unreadable command: %s", exc)
            return None
        return command

    def _screen(self, command: AnyCommand) -> bool:
        """What is settled before any epoch is: a command for another incarnation is
        refused, a reset past the fence is carried out. False: nothing more to do."""
        if command.incarnation != self.incarnation:
            self.refused_commands += 1
            log.warning("refusing command for incarnation %s (this is %s)",
                        command.incarnation, self.incarnation)
            return False
        if isinstance(command, ResetWorker) and self._past_fence():
            # Whatever its epoch: past the fence deadline every task of this incarnation is
            # already fenced off, so a reset costs nothing but a new registration. And a
            # declared-dead incarnation can confirm no epoch (no leader answers its
            # heartbeats): one that slept through two take-overs would refuse every reset
            # of the new leader, and stay dead for ever (docs/reliability.md).
            self._spawn(self._reset(f"reset by the scheduler ({command.reason})"))
            return False
        return True

    def _obey(self, command: AnyCommand, msg: Msg) -> None:
        """A command of an epoch this worker has judged: carried out if it obeys it."""
        self._claimed(command.epoch)
        if not self.epochs.obeys(command.epoch):
            self.refused_commands += 1
            log.warning("refusing command of epoch %d (obeying %d, confirmed %d)",
                        command.epoch, self.epochs.current, self.epochs.confirmed)
            return
        if isinstance(command, ResetWorker):
            self._spawn(self._reset(f"reset by the scheduler ({command.reason})"))
            return
        key = attempt_key(command.job_id, command.task_index, command.attempt_id)
        if isinstance(command, RunAttempt):
            if key in self.seen or self.winding_down:
                return
            if self._past_fence():
                log.warning("not starting %s: past this incarnation's fence deadline", key)
                return
            self._remember(key)
            running = RunningAttempt(command=command)
            self.running[key] = running
            # Nothing records (telemetry.recording): no `attempt` span, so no context.
            ctx = telemetry.extract(dict(msg.headers or {})) if telemetry.recording() else None
            running.task = asyncio.create_task(self._run(key, running, ctx))
        elif isinstance(command, KillAttempt):
            reason = command.reason or "killed by the scheduler"
            attempt = self.running.get(key)
            if attempt is None:
                if key not in self.seen and not self.winding_down:
                    # Killed before its run command got here: it must never start, and the
                    # scheduler needs the exit confirmed to free its reservation.
                    self._remember(key)
                    self._spawn(self._report(command, TaskState.KILLED,
                                             error=f"killed before it started: {reason}"))
                return
            if not attempt.killed.is_set():
                attempt.kill_reason = reason
                attempt.kill_grace = command.grace
                log.info("killing %s: %s", key, attempt.kill_reason)
                self._spawn(self._stop_attempt(attempt))

    def _past_fence(self) -> bool:
        """Whether this incarnation's tasks may no longer run (simulated hosts run none)."""
        return self.simulate is None and time.monotonic() > self.fence_deadline

    def _remember(self, key: str) -> None:
        self.seen[key] = None
        if len(self.seen) > MAX_REMEMBERED_ATTEMPTS:
            del self.seen[next(iter(self.seen))]

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _stop_attempt(self, attempt: RunningAttempt) -> None:
        attempt.killed.set()
        if attempt.process is not None:
            grace = attempt.kill_grace
            await attempt.process.stop(self.settings.kill_grace if grace is None else grace)

    # --- running one attempt ----------------------------------------------------------

    async def _report(self, cmd: RunAttempt | KillAttempt, state: TaskState,
                      exit_code: int | None = None, error: str = "",
                      timed_out: bool = False, usage: ResourceUse | None = None,
                      worker_fault: bool = False, waiting: str = "") -> None:
        if self.winding_down and state not in (TaskState.BUILDING, TaskState.RUNNING):
            return  # a worker-level event accounts for the attempts stopped now
        key = attempt_key(cmd.job_id, cmd.task_index, cmd.attempt_id)
        gpu = None
        if self.gpu_watch is not None and state in FINAL_REPORTS:
            gpu = self.gpu_watch.finish(key)
        report = AttemptReported(
            job_id=cmd.job_id, task_index=cmd.task_index, attempt_id=cmd.attempt_id,
            worker_id=self.worker_id, state=state, exit_code=exit_code, error=error,
            timed_out=timed_out, ts=time.time(), gpu=gpu, usage=usage,
            worker_fault=worker_fault, waiting=waiting,
        )
        seq = await self.report_sender.send(report)
        self.reported_seq = max(self.reported_seq, seq)
        metrics.REPORTS_BY_STATE[state].inc()

    async def _run(self, key: str, attempt: RunningAttempt, ctx: Context | None) -> None:
        cmd = attempt.command
        try:
            with tracer.start_as_current_span(
                "attempt", context=ctx,
                attributes={"berth.attempt": key, "berth.worker_id": self.worker_id},
            ) if ctx is not None else telemetry.NO_SPAN:
                await self._run_attempt(key, attempt)
        except Exception as exc:  # never let one attempt take the agent down
            log.exception("attempt %s crashed the runner", key)
            # Not the task's doing (it may not even have started): the host's, which its
            # record of failures counts toward quarantine.
            await self._report(cmd, TaskState.FAILED, error=f"worker error: {exc}",
                               worker_fault=True)
        finally:
            self.running.pop(key, None)
            if self.gpu_watch is not None:
                self.gpu_watch.forget(key)

    async def _run_attempt(self, key: str, attempt: RunningAttempt) -> None:
        cmd = attempt.command
        if self.simulate is not None:
            # As a real host would: BUILDING only when there is something to build.
            if cmd.bundle or cmd.setup:
                await self._report(cmd, TaskState.BUILDING)
            if attempt.killed.is_set():
                await self._report(cmd, TaskState.KILLED, error=attempt.kill_reason)
                return
            await self._run_process(key, attempt, self.simulate())
            return
        dirs = TaskDirs.of(self.home, cmd.job_id, cmd.task_index, cmd.attempt_id)
        try:
            dirs.create()
            env = task_environment(
                self.inherited_env, cmd.env, self.worker_id,
                gpu_devices(cmd.resources, cmd.devices),
                tpus.visibility(isinstance(cmd.resources.device, TpuDevice), cmd.devices,
                                len(self.devices)))
            env.update(dirs.env())
            if not await self._build_phase(key, attempt, dirs, env):
                return
            if cmd.timeout is not None:
                # When the task's timeout will stop it (Unix time), so it can save first.
                env["BERTH_DEADLINE"] = f"{time.time() + cmd.timeout:.3f}"
            await self._run_process(key, attempt, self._process(cmd, dirs, env))
        finally:
            if not dirs.remove_scratch_if_empty():
                await asyncio.to_thread(dirs.remove_scratch)

    async def _build_phase(self, key: str, attempt: RunningAttempt, dirs: TaskDirs,
                           env: dict[str, str]) -> bool:
        """BUILDING: the bundle unpacked into the task directory, then the setup lines. Says
        whether the command is to run; if not, the attempt's end is reported here."""
        cmd = attempt.command
        error = ""
        if cmd.bundle or cmd.setup:
            if self.builds.locked():
                # The task's pending_reason while it stays ASSIGNED (API, `berth status`,
                # dashboard), and a line of its log.
                note = (f"waiting for a build slot: {self.settings.max_builds} builds at once "
                        "on this worker (BERTH_MAX_BUILDS)")
                log.info("%s stays assigned, %s", key, note)
                await self._report(cmd, TaskState.ASSIGNED, waiting=note)
                with contextlib.suppress(Exception):
                    await self.js.publish(self._log_subject(cmd), f"{note}\n".encode(),
                                          headers={subjects.LOG_STREAM_HEADER: "build"})
            async with self.builds:
                if not attempt.killed.is_set():
                    await self._report(cmd, TaskState.BUILDING)
                    error = await self._build(key, attempt, dirs, env)
        # Nothing to build: no BUILDING report; RUNNING follows ASSIGNED directly.
        if attempt.process is not None and (why := attempt.process.fenced):
            log.warning("attempt %s was fenced off while building (%s)", key, why)
            self._spawn(self._reset(f"fenced: {why}"))
            return False
        attempt.process = None
        if attempt.killed.is_set():
            await self._report(cmd, TaskState.KILLED, error=attempt.kill_reason)
            return False
        if error:
            log.info("attempt %s: %s", key, error.partition("\n")[0])
            await self._report(cmd, TaskState.FAILED, error=error)
            return False
        return True

    async def _build(self, key: str, attempt: RunningAttempt, dirs: TaskDirs,
                     env: dict[str, str]) -> str:
        """Runs the build; its FAILED reason, or "" (also when it was killed or fenced)."""
        cmd = attempt.command
        if cmd.bundle and dirs.unpacked() != cmd.bundle:
            try:
                await self.bundles.place(cmd.bundle, dirs.task)
            except BundleUnavailable as exc:
                return str(exc)
            except OSError as exc:
                return f"bundle {cmd.bundle}: cannot unpack it: {exc}"
            dirs.mark_unpacked(cmd.bundle)
        tail = build.OutputTail()
        log_subject = self._log_subject(cmd)

        async def sink(stream: str, chunk: bytes) -> None:
            tail.add(chunk)
            await self.js.publish(log_subject, chunk, headers={subjects.LOG_STREAM_HEADER: "build"})

        loop = asyncio.get_running_loop()
        ends = None if cmd.build_timeout is None else loop.time() + cmd.build_timeout
        for line in build.setup_lines(cmd.setup, dirs.task, env.get("PATH")):
            if attempt.killed.is_set():
                return ""
            process = AttemptProcess(["sh", "-c", line], env, str(dirs.task), sink,
                                     self.fence_deadline, dirs.scratch / ".berth-fenced",
                                     zygote=self.zygote)
            try:
                await process.start()
            except OSError as exc:
                return f"build failed: cannot start sh: {exc.strerror or exc}"
            attempt.process = process
            if attempt.killed.is_set():
                self._spawn(process.stop(self.settings.kill_grace))
            late: list[bool] = []
            timer = None
            if ends is not None:
                timer = loop.call_later(max(0.0, ends - loop.time()), self._build_too_long,
                                        process, late)
            try:
                code = await process.wait()
            finally:
                if timer is not None:
                    timer.cancel()
            if process.fenced or attempt.killed.is_set():
                return ""
            if late:
                return build.failure(line, f"ran past the build_timeout of "
                                     f"{cmd.build_timeout:g}s", tail)
            if code:
                how = f"exited {code}" if code > 0 else describe_exit(code)
                return build.failure(line, how, tail)
        return ""

    def _build_too_long(self, process: AttemptProcess, late: list[bool]) -> None:
        late.append(True)
        self._spawn(process.stop(self.settings.kill_grace))

    async def _run_process(self, key: str, attempt: RunningAttempt, process: Runnable) -> None:
        cmd = attempt.command
        try:
            await process.start()
        except OSError as exc:
            await self._report(cmd, TaskState.FAILED, exit_code=127,
                               error=f"cannot start {cmd.command[0]!r}: {exc.strerror or exc}")
            return
        attempt.process = process
        if process.pid is not None:
            self._journal(self.pid_journal.started, key, process.pid)
        if attempt.killed.is_set():  # a kill that arrived while the process was starting
            self._spawn(process.stop(self.settings.kill_grace))
        timer = None
        if cmd.timeout is not None:
            timer = asyncio.get_running_loop().call_later(
                cmd.timeout, self._time_out, attempt, cmd.timeout)
        try:
            await self._report(cmd, TaskState.RUNNING)
            code = await process.wait()
        finally:
            if timer is not None:
                timer.cancel()
            if process.pid is not None:
                self._journal(self.pid_journal.ended, key)
        if why := process.fenced:
            # Killed by its supervisor: this incarnation lost the right to run. Its exit is
            # not reported; the next incarnation's registration accounts for it.
            log.warning("attempt %s was fenced off (%s)", key, why)
            self._spawn(self._reset(f"fenced: {why}"))
            return
        usage = process.usage
        if attempt.killed.is_set():
            await self._report(cmd, TaskState.KILLED, exit_code=code, error=attempt.kill_reason,
                               timed_out=attempt.timed_out, usage=usage)
        elif code == 0:
            await self._report(cmd, TaskState.SUCCEEDED, exit_code=0, usage=usage)
        else:
            await self._report(cmd, TaskState.FAILED, exit_code=code, error=describe_exit(code),
                               usage=usage)

    def _journal(self, record: Callable[..., None], *args: object) -> None:
        try:
            record(*args)
        except OSError as exc:  # a full disk: the attempt runs on without its backstop
            log.warning("could not record an attempt's process group in %s: %s",
                        self.pid_journal.path, exc)

    def _log_subject(self, cmd: RunAttempt) -> str:
        return subjects.attempt_logs(self.worker_id, cmd.job_id, cmd.task_index, cmd.attempt_id)

    def _process(self, cmd: RunAttempt, dirs: TaskDirs, env: dict[str, str]) -> AttemptProcess:
        log_subject = self._log_subject(cmd)

        async def sink(stream: str, chunk: bytes) -> None:
            await self.js.publish(log_subject, chunk, headers={subjects.LOG_STREAM_HEADER: stream})

        return AttemptProcess(cmd.command, env, str(dirs.task), sink, self.fence_deadline,
                              dirs.scratch / ".berth-fenced", dirs.scratch / ".berth-usage",
                              self.zygote)

    def _time_out(self, attempt: RunningAttempt, timeout: float) -> None:
        if attempt.killed.is_set():
            return
        attempt.kill_reason = f"timed out: ran longer than the task timeout of {timeout:g}s"
        attempt.timed_out = True
        log.info("%s", attempt.kill_reason)
        self._spawn(self._stop_attempt(attempt))


def heartbeat_of(worker_id: str, incarnation: str, running: Collection[str], start: str,
                 max_bytes: int = bounded.MAX_MESSAGE_BYTES) -> Heartbeat:
    """A heartbeat listing the attempts `running`: all of them when they fit in
    `max_bytes`, else the window of them from `start` on (Heartbeat.covers_from/to), so a
    worker with 100,000 attempts still sends messages NATS accepts."""
    def size(key: str) -> int:
        return len(key.encode()) + 3  # quotes and a comma

    hb = Heartbeat(worker_id=worker_id, incarnation=incarnation, ts=time.time())
    if not start and sum(size(k) for k in running) <= max_bytes:
        hb.attempts = list(running)
        return hb
    hb.attempts, hb.covers_to = bounded.window(sorted(running), start, size, max_bytes)
    hb.covers_from = start
    return hb


def parse_args(argv: list[str] | None = None, nvml: gpus.Nvml | bool | None = True,
               tpu_root: Path | None = Path("/"), environ: Mapping[str, str] | None = None
               ) -> argparse.Namespace:
    """`nvml`: the NVML binding to discover GPUs with (True: the real one, if installed;
    False: discover none, e.g. for simulated hosts). `tpu_root`: where to look for TPU
    chips (a fixture directory in tests; None: discover none), described by `environ`
    (default: this process's environment)."""
    parser = argparse.ArgumentParser(
        prog="berth run worker",
        description="Run a berth worker agent: registers this host, runs assigned tasks.",
    )
    parser.add_argument("--id", default=socket.gethostname(),
                        help="worker id, unique in the cluster (default: the host name)")
    parser.add_argument("--cpu", type=float, default=float(os.cpu_count() or 1),
                        help="cpu cores offered (default: all cores)")
    parser.add_argument("--memory-mb", type=int, default=_total_memory_mb(),
                        help="memory offered in MiB (default: all memory)")
    parser.add_argument("--disk-mb", type=int, default=0,
                        help="scratch disk offered in MiB (default: 0)")
    device = parser.add_mutually_exclusive_group()
    device.add_argument("--gpu", metavar="VARIANT:COUNT",
                        help="GPUs offered, e.g. --gpu h100:8 (default: every GPU NVML "
                        "finds; without NVML, devices 0..COUNT-1 unchecked)")
    device.add_argument("--tpu", metavar="VARIANT:TOPOLOGY:COUNT",
                        help="TPU chips offered, e.g. --tpu v5p:2x2x1:4 (default: the chips "
                        "a TPU VM exposes, docs/tpus.md; none found: chips 0..COUNT-1 "
                        "unchecked)")
    parser.add_argument("--tpu-metadata", nargs="?", const=tpus.GCE_ATTRIBUTES, default=None,
                        metavar="URL", help="also read the TPU's type, topology and worker "
                        "number from the GCE metadata server (a TPU VM where the TPU_* "
                        "variables are not set; default URL: the GCE server; 1 s timeout)")
    parser.add_argument("--attribute", "-a", action="append", default=[], metavar="KEY=VALUE",
                        help="a worker attribute, e.g. -a zone=us-east5-a, -a tpu-name=slice-a "
                        "-a tpu-worker-id=0 (repeatable)")
    parser.add_argument("--address", default="",
                        help="address other tasks reach this worker's tasks at "
                        "(default: this host's IP)")
    sim = parser.add_argument_group(
        "simulated hosts", "Host N simulated workers in this process (for benchmarks): each "
        "speaks the real worker protocol, with the resources and attributes above, and "
        "'runs' a task for a drawn time instead of starting its command.")
    sim.add_argument("--simulate", type=int, default=0, metavar="N",
                     help="number of simulated workers, named <id>-00000 ... (default: 0, a "
                     "real worker)")
    sim.add_argument("--sim-runtime", default="exp:1.0", metavar="DIST",
                     help="task run time in seconds: const:S, uniform:A:B, exp:MEAN or "
                     "lognormal:MU:SIGMA (default: exp:1.0)")
    sim.add_argument("--sim-fail-rate", type=float, default=0.0, metavar="P",
                     help="probability that a task exits 1 (default: 0)")
    sim.add_argument("--sim-slice-size", type=int, default=0, metavar="K",
                     help="group consecutive workers into slices of K: attributes "
                     "tpu-name=<id>-slice-J and tpu-worker-id=0..K-1 (default: no slices)")
    sim.add_argument("--sim-seed", type=int, default=None, help="seed for the run times")
    args = parser.parse_args(argv)
    if args.simulate < 0:
        parser.error("--simulate: must be 0 or more")
    if not 0 <= args.sim_fail_rate <= 1:
        parser.error("--sim-fail-rate: must be between 0 and 1")
    if args.sim_slice_size < 0:
        parser.error("--sim-slice-size: must be 0 or more")
    try:
        args.run_time = simulation.RunTime.parse(args.sim_runtime)
    except ValueError as exc:
        parser.error(f"--sim-runtime {exc}")
    attributes = {}
    for item in args.attribute:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--attribute {item!r}: expected KEY=VALUE")
        attributes[name] = value
    args.attributes = attributes
    offer: dict[str, object] = {"cpu": args.cpu, "memory_mb": args.memory_mb,
                                 "disk_mb": args.disk_mb}
    args.devices = ()
    environ = os.environ if environ is None else environ
    # Simulated hosts are not this host: they offer only what the flags say.
    if args.tpu_metadata and not args.simulate:
        # The variables, where set (GKE), win over the metadata server.
        environ = {**tpus.metadata_environment(args.tpu_metadata), **environ}
    found_tpus = (tpus.discover(tpu_root, environ) if tpu_root is not None
                  and not args.simulate else tpus.Tpus(note="not discovered"))
    if args.tpu or (not args.gpu and found_tpus.devices):
        tpu_flag = None
        if args.tpu:
            parts = args.tpu.split(":")
            if len(parts) != 3:
                parser.error(f"--tpu {args.tpu!r}: expected VARIANT:TOPOLOGY:COUNT")
            tpu_flag = (parts[0], parts[1], _count(parser, parts[2]))
        try:
            variant, topology, args.devices = tpus.offered(found_tpus, tpu_flag)
        except device_offer.OfferError as exc:
            parser.error(str(exc))
        offer["device"] = {"type": "tpu", "variant": variant, "topology": topology,
                           "count": len(args.devices)}
        # An operator's -a wins over what was discovered.
        args.attributes = {**tpus.attributes(found_tpus), **attributes}
    else:
        flag = None
        if args.gpu:
            variant, _, count = args.gpu.partition(":")
            flag = (variant, _count(parser, count))
        binding = gpus.real_nvml() if nvml is True else (nvml or None)
        found = (gpus.Gpus(note="simulated hosts") if args.simulate else gpus.restrict(
            gpus.discover(binding), environ.get("CUDA_VISIBLE_DEVICES")))
        try:
            variant, args.devices = gpus.offered(found, flag)
        except device_offer.OfferError as exc:
            parser.error(str(exc))
        if args.devices:
            offer["device"] = {"type": "gpu", "variant": variant, "count": len(args.devices)}
    try:
        args.resources = msgspec.convert(offer, Resources)
    except msgspec.ValidationError as exc:
        parser.error(f"resources: {exc}")
    return args


def _count(parser: argparse.ArgumentParser, text: str) -> int:
    if not text.isdigit():
        parser.error(f"device count {text!r} is not a whole number")
    return int(text)


def _default_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _total_memory_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        return 1024


async def run(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> None:
    # Simulated hosts share one connection, so they need an identity that may speak for
    # all of them: an admin's (they are a benchmark tool, never a real host).
    role, scope = (Role.ADMIN, "") if args.simulate else (Role.WORKER, args.id)
    nc = await nats_io.connect_service(settings, f"berth-worker-{args.id}", role, scope)
    serving = None
    try:
        if args.simulate:
            serving = await shared_metrics.serve(settings.metrics_host, settings.metrics_port)
            await run_simulated(settings, args, nc, stop)
        else:
            agent = WorkerAgent(settings, nc, args.id, args.resources, args.attributes,
                                args.address, devices=args.devices, nvml=gpus.real_nvml())
            # Its gauges before the server answers: a scrape of a just-restarted agent
            # found the server up and the worker's own series missing.
            metrics.instrument([agent])
            serving = await shared_metrics.serve(settings.metrics_host, settings.metrics_port)
            await agent.serve(stop)
    finally:
        if serving is not None:
            await serving.stop()
        await nats_io.close(nc)


async def run_simulated(settings: Settings, args: argparse.Namespace, nc: NATS,
                        stop: asyncio.Event) -> None:
    hosts = simulation.simulated_hosts(args.id, args.simulate, args.resources,
                                       args.attributes, args.sim_slice_size)
    make_process = simulation.process_factory(args.run_time, args.sim_fail_rate, args.sim_seed)
    reports = nats_io.EventPublisher(nc.jetstream())
    agents = [WorkerAgent(settings, nc, h.worker_id, h.resources, h.attributes,
                          args.address or "127.0.0.1", simulate=make_process, reports=reports)
              for h in hosts]
    metrics.instrument(agents)

    async def on_leader(msg: Msg) -> None:  # one subscription for all of them
        with contextlib.suppress(msgspec.DecodeError):
            ann = decode(leader_decoder, msg.data)
            for agent in agents:
                agent.on_leader(ann)

    leader_sub = await nc.subscribe(subjects.LEADER, cb=on_leader)
    log.info("simulating %d workers (%s each; run time %s, fail rate %g)", len(agents),
             args.resources, args.sim_runtime, args.sim_fail_rate)
    # Heartbeats spread over the interval, as independent hosts' would be.
    rng = random.Random(args.sim_seed)
    try:
        await asyncio.gather(*(
            agent.serve(stop, follow_leader=False,
                        first_heartbeat_after=rng.uniform(0, settings.heartbeat_interval))
            for agent in agents))
    finally:
        await leader_sub.unsubscribe()


def main(argv: list[str] | None = None) -> None:
    settings = Settings.from_env()
    args = parse_args(argv)
    # One agent per worker id and data dir: a second would kill the first one's tasks as
    # orphans and share its task homes (shared/dir_lock.py).
    try:
        lock = dir_lock.acquire(Path(settings.data_dir) / f"worker-{args.id}.lock",
                                f"worker {args.id}")
    except dir_lock.DirLocked as exc:
        raise SystemExit(f"berth worker: {exc}") from None
    try:
        service.run("worker", lambda stop: run(settings, args, stop))
    finally:
        lock.release()
