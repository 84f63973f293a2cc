"""Workspace bundles, the BUILDING phase and task directories, with real processes: `berth
submit` as a user runs it, a real worker building and running the task (docs/workspaces.md)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS

from berth import cli_views, workspace
from berth.client import submit_job
from berth.services.submitter.intake import intake
from berth.services.worker_agent import build, bundle_stream, bundle_trees, task_dirs
from berth.services.worker_agent.bundle_cache import BundleCache
from berth.shared import bundles, nats_io
from berth.shared.credentials import Role
from berth.shared.messages import JobSpec, Resources, SubmitRejected, reports_in
from berth.shared.states import TaskState
from berth.stack import Stack
from tests.conftest import wait_for_job, wait_until
from tests.test_cli import run_berth

S = TaskState
SMALL = Resources(cpu=0.5, memory_mb=64)
ROOT = Path(__file__).resolve().parent.parent


def make_tree(root: Path) -> Path:
    (root / "mypkg").mkdir(parents=True)
    (root / "mypkg" / "__init__.py").write_text("VALUE = '42'\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"x" * 4096)
    (root / "notes.log").write_text("local\n")
    (root / ".gitignore").write_text("*.log\n")
    (root / ".berthignore").write_text("data/\n")
    (root / "sub").mkdir()
    (root / "sub" / ".gitignore").write_text("secret.txt\n")
    (root / "sub" / "secret.txt").write_text("no\n")
    (root / "sub" / "kept.txt").write_text("yes\n")
    return root


# --- packing (pure) -----------------------------------------------------------------------


def test_a_tree_packs_reproducibly_and_honours_ignore_files(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "ws")
    first, second = io.BytesIO(), io.BytesIO()
    packed = bundles.pack(root, first)
    (root / "mypkg" / "__init__.py").touch()  # a new mtime changes nothing
    assert bundles.pack(root, second) == packed
    assert first.getvalue() == second.getvalue()
    with tarfile.open(fileobj=io.BytesIO(first.getvalue())) as tar:
        names = tar.getnames()
    assert names == [".berthignore", ".gitignore", "mypkg", "mypkg/__init__.py", "run.sh",
                     "sub", "sub/.gitignore", "sub/kept.txt"]
    assert packed.files == 6
    (root / "mypkg" / "__init__.py").write_text("VALUE = '43'\n")
    assert bundles.pack(root, io.BytesIO()).digest != packed.digest
    out = tmp_path / "out"
    archive = tmp_path / "b.tar"
    archive.write_bytes(first.getvalue())
    bundles.unpack(archive, out)
    assert (out / "mypkg" / "__init__.py").read_text() == "VALUE = '42'\n"
    assert (out / "run.sh").stat().st_mode & 0o111


def unpacked_tree(tmp_path: Path) -> Path:
    """A bundle of make_tree (with a symlink) unpacked and sealed as the worker caches it."""
    root = make_tree(tmp_path / "ws")
    (root / "sub" / "link").symlink_to("kept.txt")
    archive = tmp_path / "b.tar"
    with archive.open("wb") as f:
        bundles.pack(root, f)
    tree = tmp_path / "cache" / "tree"
    bundles.unpack(archive, tree)
    held = bundle_trees.seal(tree)
    assert held == bundle_trees.footprint(tree) and held.files == 6 and held.bytes > 0
    return tree


def test_task_directories_share_one_read_only_tree_and_a_write_to_it_is_noticed(
        tmp_path: Path) -> None:
    tree = unpacked_tree(tmp_path)
    one, two = tmp_path / "tasks" / "0", tmp_path / "tasks" / "1"
    (one / "sub").mkdir(parents=True)
    (one / "sub" / "kept.txt").write_text("an older bundle's\n")
    (one / "checkpoint").write_text("mine")
    bundle_trees.place(tree, one)
    bundle_trees.place(tree, two)
    for task in (one, two):
        assert (task / "mypkg" / "__init__.py").read_text() == "VALUE = '42'\n"
        assert (task / "sub" / "kept.txt").read_text() == "yes\n"  # the bundle's wins
        assert os.readlink(task / "sub" / "link") == "kept.txt"
        assert (task / "run.sh").stat().st_mode & 0o777 == 0o555
        assert (task / "mypkg" / "__init__.py").stat().st_mode & 0o777 == 0o444
    assert (one / "checkpoint").read_text() == "mine"  # the task's own files stay
    # Shared, not copied (ext4 here: hard links; a reflink would be a file of its own).
    shared = (tree / "run.sh").stat()
    hard_links = (one / "run.sh").stat().st_ino == shared.st_ino
    assert hard_links or shared.st_nlink == 1
    # Replacing a bundled file is the task's own business.
    (one / "new.py").write_text("VALUE = 'mine'\n")
    os.replace(one / "new.py", one / "mypkg" / "__init__.py")
    (one / "sub" / "kept.txt").unlink()
    for where in (tree, two):
        assert (where / "mypkg" / "__init__.py").read_text() == "VALUE = '42'\n"
        assert (where / "sub" / "kept.txt").read_text() == "yes\n"
    # With BERTH_BUNDLE_COPIES, a task's files are its own and writable.
    own = tmp_path / "tasks" / "own"
    bundle_trees.place(tree, own, copies=True)
    assert (own / "run.sh").stat().st_ino != shared.st_ino
    (own / "run.sh").write_text("#!/bin/sh\necho mine\n")
    assert (tree / "run.sh").read_text() == "#!/bin/sh\necho hi\n"
    task_dirs.remove_stale(tmp_path, 0, 0, [])  # read-only files go with their directory
    assert not list((tmp_path / "tasks").iterdir())
    # A write to a shared file in place (as root, whom read-only does not stop, or after a
    # chmod): the next placement notices, and the worker fetches the bundle again.
    bundle_trees.place(tree, two)
    (two / "run.sh").chmod(0o755)
    (two / "run.sh").write_text("#!/bin/sh\necho changed\n")
    if hard_links:
        with pytest.raises(bundle_trees.TreeChanged, match=r"^run\.sh was written"):
            bundle_trees.place(tree, tmp_path / "tasks" / "2")


async def test_a_bundle_is_unpacked_and_hashed_as_its_chunks_arrive(tmp_path: Path) -> None:
    """The worker's fetch path without the network: chunks of any size, a backlog smaller
    than one chunk (feed waits for the thread), every byte hashed (the tar's end padding
    too); a tar that would write outside its directory is refused, and still hashed."""
    root = make_tree(tmp_path / "ws")
    (root / "weights.bin").write_bytes(os.urandom(300_000))
    archive = io.BytesIO()
    packed = bundles.pack(root, archive)
    data = archive.getvalue()
    unpacker = bundle_stream.StreamUnpack(tmp_path / "tree", backlog=50_000)
    for start in range(0, len(data), 77_777):
        await unpacker.feed(data[start:start + 77_777])
    done = await unpacker.finish()
    assert bundles.digest_of(done.sha256) == packed.digest and done.error is None
    assert done.held == bundle_trees.Footprint(packed.size, packed.files)
    assert (tmp_path / "tree" / "weights.bin").read_bytes() == (root / "weights.bin"
                                                                ).read_bytes()
    assert (tmp_path / "tree" / "run.sh").stat().st_mode & 0o777 == 0o555  # sealed
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        info = tarfile.TarInfo("../outside.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    unpacker = bundle_stream.StreamUnpack(tmp_path / "evil")
    await unpacker.feed(evil.getvalue())
    done = await unpacker.finish()
    assert isinstance(done.error, tarfile.FilterError) and done.held is None
    assert done.sha256 == hashlib.sha256(evil.getvalue()).hexdigest()
    assert not (tmp_path / "outside.txt").exists()
    # A fetch that fails half way stops the thread, which lets go of the directory.
    unpacker = bundle_stream.StreamUnpack(tmp_path / "half")
    await unpacker.feed(data[:20_000])
    await unpacker.abort()
    assert unpacker.result.done()


def test_bad_workspaces_are_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(bundles.BundleError, match=r"^workspace '.*nope': no such directory$"):
        bundles.pack(tmp_path / "nope", io.BytesIO())
    root = make_tree(tmp_path / "ws")
    (root / "model.ckpt").write_bytes(b"\0" * 300_000)
    with pytest.raises(bundles.BundleError) as caught:
        bundles.pack(root, io.BytesIO(), limit=100_000)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("workspace is 293.0 KiB, over the 97.7 KiB limit")
    assert "largest files: model.ckpt (293.0 KiB), run.sh (18 bytes)," in message


def test_env_file_is_read_under_the_specs_env(tmp_path: Path) -> None:
    (tmp_path / "job.env").write_text("# settings\nA=1\nexport B='two words'\nC=from-file\n")
    assert workspace.read_env_file(tmp_path / "job.env") == {
        "A": "1", "B": "two words", "C": "from-file"}
    (tmp_path / "bad.env").write_text("JUSTAKEY\n")
    with pytest.raises(bundles.BundleError, match="'JUSTAKEY' has no value"):
        workspace.read_env_file(tmp_path / "bad.env")
    with pytest.raises(bundles.BundleError, match="no such file"):
        workspace.read_env_file(tmp_path / "missing.env")


async def test_env_file_values_sit_under_the_specs_env_and_need_no_connection(
        tmp_path: Path) -> None:
    (tmp_path / "job.env").write_text("A=from-file\nB=from-file\n")
    payload = json.dumps({"name": "x", "command": ["true"], "env_file": "job.env",
                          "env": {"B": "from-spec"}}).encode()

    def no_connection() -> Any:
        raise AssertionError("nothing to upload: no connection")

    out = json.loads(await workspace.resolve(payload, tmp_path, no_connection, print))
    assert out == {"name": "x", "command": ["true"],
                   "env": {"A": "from-file", "B": "from-spec"}}
    plain = json.dumps({"name": "x", "command": ["true"]}).encode()
    assert await workspace.resolve(plain, tmp_path, no_connection, print) == plain


def test_a_raw_submit_with_a_client_side_field_is_told_what_to_send_instead() -> None:
    spec = {"name": "x", "command": ["true"], "workspace": "."}
    rejected = intake(json.dumps(spec).encode(), 1, 1, 100_000)
    assert isinstance(rejected, SubmitRejected)
    assert rejected.reason == (
        "invalid job spec: Object contains unknown field `workspace` (workspace is read by "
        "`berth submit`; another client should pack and upload the directory, then send "
        "its digest as `bundle`: docs/protocol.md)")


def test_setup_defaults_to_uv_sync_only_for_a_uv_project_with_uv_installed(
        tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    assert build.setup_lines(["make"], tmp_path, str(bin_dir)) == ["make"]
    assert build.setup_lines([], tmp_path, str(bin_dir)) == []
    (tmp_path / "uv.lock").write_text("")
    assert build.setup_lines([], tmp_path, str(bin_dir)) == []  # no uv on PATH
    (bin_dir / "uv").write_text("#!/bin/sh\n")
    (bin_dir / "uv").chmod(0o755)
    assert build.setup_lines([], tmp_path, str(bin_dir)) == ["uv sync --frozen"]


def test_old_task_directories_go_by_age_then_least_recently_used_above_the_cap() -> None:
    now = 1_000_000.0
    day = 86400.0
    jobs = [task_dirs.JobDir("old", now - 9 * day, 10), task_dirs.JobDir("a", now - 3, 50),
            task_dirs.JobDir("b", now - 2, 50), task_dirs.JobDir("c", now - 1, 50),
            task_dirs.JobDir("running-old", now - 30 * day, 10)]
    assert task_dirs.to_remove(jobs, 7 * day, 0, {"running-old"}, now) == ["old"]
    assert task_dirs.to_remove(jobs, 7 * day, 110, {"running-old"}, now) == ["a", "old"]
    assert task_dirs.to_remove(jobs, 7 * day, 60, {"running-old", "a"}, now) == [
        "b", "c", "old"]
    assert task_dirs.to_remove(jobs, 7 * day, 1, {"running-old"}, now) == [
        "a", "b", "c", "old"]


def test_task_directories_are_removed_from_disk(tmp_path: Path) -> None:
    for job in ("j1-aaaa", "j2-bbbb"):
        for task in (0, 1):
            dirs = task_dirs.TaskDirs.of(tmp_path, job, task, 0)
            dirs.create()
            (dirs.task / "ckpt").write_bytes(b"x" * 1000)
            dirs.mark_unpacked("sha256:0")
    # Scratch left by attempts whose agent died, one as berth laid it out before 2026-11-29.
    (tmp_path / "scratch" / "j1-aaaa" / "0.0").mkdir(parents=True)
    # A job's last use is its newest entry's: one task used lately keeps the whole job.
    for entry in (tmp_path / "tasks").iterdir():
        if entry.name != "j2-bbbb.1":
            os.utime(entry, (0, 0))
    assert task_dirs.remove_stale(tmp_path, 3600, 0, []) == ["j1-aaaa"]
    assert sorted(p.name for p in (tmp_path / "tasks").iterdir()) == [
        "j2-bbbb.0", "j2-bbbb.0.bundle", "j2-bbbb.1", "j2-bbbb.1.bundle"]
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == [
        "j2-bbbb.0.0", "j2-bbbb.1.0"]
    # Above the size cap, the least recently used job goes, unless it runs here.
    assert task_dirs.remove_stale(tmp_path, 3600, 500, ["j2-bbbb"]) == []
    assert task_dirs.remove_stale(tmp_path, 3600, 500, []) == ["j2-bbbb"]
    assert not list((tmp_path / "tasks").iterdir())


def test_an_attempts_directories_are_made_and_its_task_marked_used(tmp_path: Path) -> None:
    first = task_dirs.TaskDirs.of(tmp_path, "j1-aaaa", 0, 0)
    first.create()  # nothing there yet: `tasks/` and `scratch/` made too
    assert first.task == tmp_path / "tasks" / "j1-aaaa.0"
    assert first.scratch == tmp_path / "scratch" / "j1-aaaa.0.0"
    assert first.task.is_dir() and first.scratch.is_dir()
    os.utime(first.task, (0, 0))
    retry = task_dirs.TaskDirs.of(tmp_path, "j1-aaaa", 0, 1)
    (first.task / "ckpt").write_bytes(b"x")
    retry.create()  # the task directory is kept across attempts, and marked used
    assert retry.task == first.task
    assert (retry.task / "ckpt").read_bytes() == b"x" and retry.scratch.is_dir()
    assert first.task.stat().st_mtime > 0
    os.utime(first.task, (0, 0))
    retry.create()  # both there already (the same attempt again): still marked used
    assert first.task.stat().st_mtime > 0
    # An empty scratch directory goes at once; one with files is left to rmtree.
    assert first.remove_scratch_if_empty() and not first.scratch.exists()
    assert first.remove_scratch_if_empty()  # gone already
    (retry.scratch / "tmp").write_bytes(b"x")
    assert not retry.remove_scratch_if_empty() and retry.scratch.exists()
    retry.remove_scratch()
    assert not retry.scratch.exists()


def test_task_directories_of_the_old_layout_are_moved_with_their_last_use(
        tmp_path: Path) -> None:
    """`tasks/<job>/<task>/` (before 2026-11-29) becomes `tasks/<job>.<task>/` when the agent
    starts: a resumed attempt finds its checkpoint, and the job's age is kept."""
    old = tmp_path / "tasks" / "j7-abcd"
    (old / "0").mkdir(parents=True)
    (old / "0" / "ckpt").write_bytes(b"step 41")
    (old / "0.bundle").write_text("sha256:1\n")
    (old / "3").mkdir()
    os.utime(old, (1000.0, 1000.0))
    # One whose new place is taken already (an agent stopped mid-move) stays where it was.
    (tmp_path / "tasks" / "j7-abcd.3").mkdir()
    assert task_dirs.move_old_layout(tmp_path) == 2
    resumed = task_dirs.TaskDirs.of(tmp_path, "j7-abcd", 0, 5)
    assert (resumed.task / "ckpt").read_bytes() == b"step 41"
    assert resumed.unpacked() == "sha256:1"
    assert resumed.task.stat().st_mtime == 1000.0
    assert (old / "3").is_dir()
    assert task_dirs.move_old_layout(tmp_path) == 0  # again: nothing more to move
    (jobs,) = task_dirs.job_dirs(tmp_path, sizes=True)
    assert jobs.name == "j7-abcd" and jobs.size >= len(b"step 41")


def test_status_shows_a_build_failures_output_tail_below_its_attempt() -> None:
    error = "build failed: make exited 2\nstep one\noops"
    attempt = {"attempt_id": 0, "worker_id": "local-0", "state": "failed",
               "worker_failure": False, "exit_code": None, "error": error,
               "assigned_at": None, "started_at": None, "finished_at": None}
    job = {"job_id": "j1-aaaa", "name": "b", "state": "failed",
           "error": f"job failed: task 0: {error}",
           "tasks": [{"index": 0, "state": "failed", "pending_reason": "", "error": error,
                      "refused_reports": [], "attempts": [attempt]}]}
    assert cli_views.format_job(job).splitlines() == [
        "job j1-aaaa (b): failed",
        "  error: job failed: task 0: build failed: make exited 2",
        "  task 0: failed  (build failed: make exited 2)",
        "    attempt 0   local-0        failed, build failed: make exited 2  [assigned -]",
        "      | step one",
        "      | oops"]


def test_status_says_what_an_assigned_task_waits_for_on_its_worker() -> None:
    slot = "waiting for a build slot: 4 builds at once on this worker (BERTH_MAX_BUILDS)"
    attempt = {"attempt_id": 0, "worker_id": "local-0", "state": "assigned",
               "worker_failure": False, "exit_code": None, "error": "",
               "assigned_at": None, "started_at": None, "finished_at": None}
    job = {"job_id": "j1-aaaa", "name": "b", "state": "pending", "error": "",
           "tasks": [{"index": 0, "state": "assigned", "pending_reason": slot, "error": "",
                      "refused_reports": [], "attempts": [attempt]}]}
    assert cli_views.format_job(job).splitlines()[1] == f"  task 0: assigned  (waiting: {slot})"


# --- with a running stack -----------------------------------------------------------------


def job_of(stack: Stack, job_id: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{stack.api_url}/api/jobs/{job_id}", timeout=10).json()
    return result


def logs_of(stack: Stack, job_id: str, index: int = 0) -> str:
    return httpx.get(f"{stack.api_url}/api/jobs/{job_id}/tasks/{index}/logs", timeout=10).text


CHECK_TASK = """
import os, sys, mypkg
assert sys.prefix == os.path.join(os.environ['BERTH_TASK_DIR'], '.venv')  # uv sync made it
assert open('built.txt').read() == mypkg.VALUE
assert not os.path.exists('data') and not os.path.exists('notes.log')
assert os.getcwd() == os.environ['BERTH_TASK_DIR']
assert os.path.isdir(os.environ['BERTH_SCRATCH_DIR'])
print('imported', mypkg.VALUE, os.environ['FROM_ENV_FILE'], os.environ['BERTH_RETRY_COUNT'])
"""


def test_a_workspace_is_uploaded_once_built_on_a_worker_and_imported(
        make_stack, tmp_path: Path) -> None:
    stack: Stack = make_stack(workers=1)
    root = make_tree(tmp_path / "project")
    # A uv project (no dependencies, so no index is needed) with its lock, made here.
    (root / "pyproject.toml").write_text(
        '[project]\nname = "mypkg"\nversion = "0.1.0"\nrequires-python = ">=3.11"\n'
        'dependencies = []\n\n[tool.uv]\npackage = false\n')
    uv = shutil.which("uv", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    assert uv, "uv is a test dependency"
    subprocess.run([uv, "lock", "--offline"], cwd=root, check=True, capture_output=True)
    (root / "job.env").write_text(f"FROM_ENV_FILE=yes\nUV_OFFLINE=1\n"
                                  f"PATH={Path(uv).parent}:{os.environ['PATH']}\n")
    spec = root / "job.yaml"
    spec.write_text(
        "name: bundled\nworkspace: .\nenv_file: job.env\n"
        "resources: {cpu: 0.5, memory_mb: 64}\n"
        "setup:\n"
        "  - echo building task $BERTH_TASK_INDEX\n"
        "  - uv sync --frozen\n"
        "  - python3 -c \"import mypkg; open('built.txt', 'w').write(mypkg.VALUE)\"\n"
        f"command: [.venv/bin/python, -c, {CHECK_TASK!r}]\n")
    env = {"BERTH_NATS_URL": stack.nats.url, "BERTH_API_URL": stack.api_url,
           "BERTH_NATS_CREDS": str(stack.creds_for(Role.SUBMIT, "ada"))}
    first = run_berth("submit", str(spec), "--wait", "--timeout", "60", env=env)
    assert first.returncode == 0, first.stderr + first.stdout
    assert "uploaded" in first.stderr and "uploaded 0 bytes" not in first.stderr
    job_id = first.stdout.splitlines()[0]
    assert f"job {job_id} (bundled): succeeded" in first.stdout
    logs = logs_of(stack, job_id)
    assert "building task 0" in logs and "imported 42 yes 0" in logs
    # The same tree again, with --workspace and a spec elsewhere: nothing is uploaded. With
    # no `setup`, a bundle with a uv.lock gets `uv sync --frozen` (uv is on the task's PATH).
    other = tmp_path / "elsewhere.yaml"
    other.write_text(
        "name: default-build\nresources: {cpu: 0.5, memory_mb: 64}\n"
        f"env: {{UV_OFFLINE: '1', PATH: '{Path(uv).parent}:{os.environ['PATH']}'}}\n"
        "command: [.venv/bin/python, -c, 'import sys, mypkg; print(sys.prefix)']\n")
    again = run_berth("submit", str(other), "--workspace", str(root), "--wait", "--timeout",
                      "60", env=env)
    assert again.returncode == 0, again.stderr + again.stdout
    digest = first.stderr.split("bundle ")[1].split()[0]
    assert f"bundle {digest} (" in again.stderr and "uploaded 0 bytes" in again.stderr
    job_id = again.stdout.splitlines()[0]
    assert logs_of(stack, job_id).strip().endswith("/.venv")


def test_a_bad_workspace_is_one_line_before_anything_connects(tmp_path: Path) -> None:
    env = {"BERTH_NATS_URL": "nats://127.0.0.1:9", "BERTH_DATA_DIR": str(tmp_path / "d")}
    spec = tmp_path / "job.yaml"
    spec.write_text("name: nowhere\nworkspace: ./missing\ncommand: [true]\n")
    missing = run_berth("submit", str(spec), env=env)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"berth: workspace '{tmp_path / 'missing'}': no such directory"]
    root = make_tree(tmp_path / "ws")
    (root / "weights.bin").write_bytes(b"\0" * 200_000)
    spec.write_text("name: heavy\nworkspace: ws\ncommand: [true]\n")
    heavy = run_berth("submit", str(spec), env={**env, "BERTH_BUNDLE_MAX_MB": "0.1"})
    assert heavy.returncode == 2
    [line] = heavy.stderr.strip().splitlines()
    assert "over the 102.4 KiB limit" in line and "weights.bin (195.3 KiB)" in line


RESUMABLE = """
import os, sys, time
ckpt = os.path.join(os.environ['BERTH_TASK_DIR'], 'ckpt')
if os.path.exists(ckpt):
    print('resumed from', open(ckpt).read(), 'retry', os.environ['BERTH_RETRY_COUNT'])
    sys.exit(0)
assert float(os.environ['BERTH_DEADLINE']) > time.time()
open(ckpt, 'w').write('step 7')
print('saved', flush=True)
time.sleep(60)
"""


async def reports_of(nc: NATS, job_id: str) -> list[tuple[TaskState, str]]:
    """The (state, waiting) of every attempt report of the job in the event log so far."""
    last = await nats_io.last_event_seq(nc.jetstream())
    out = []
    async for record in nats_io.follow_events(nc.jetstream()):
        out += [(r.state, r.waiting) for r in reports_in(record.event) if r.job_id == job_id]
        if record.seq >= last:
            return out
    raise AssertionError("the stream ended")


async def test_failing_slow_and_missing_builds_fail_and_a_resumable_task_resumes(
        make_stack, nc, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One worker, for time: the BUILDING phase's failures, and a task stopped at its timeout
    that resumes from its checkpoint in BERTH_TASK_DIR."""
    stack: Stack = make_stack(workers=1, worker_cpu=4, extra_env={"BERTH_MAX_BUILDS": "1"})
    slow = await submit_job(nc, JobSpec(
        name="slowbuild", command=["echo", "never"], resources=SMALL, setup=["sleep 30"],
        build_timeout=1))
    await wait_until(lambda: job_of(stack, str(slow.job_id)).get("state") == "running",
                     what="the slow build to start")
    resumable = await submit_job(nc, JobSpec(
        name="resumes", command=["python3", "-c", RESUMABLE], resources=SMALL, timeout=1.5,
        resumable=True))
    no_budget = await submit_job(nc, JobSpec(
        name="noresume", command=["python3", "-c", RESUMABLE], resources=SMALL, timeout=1.5,
        resumable=True, max_resumes=0))
    lost = await submit_job(nc, JobSpec(name="lost", command=["true"], resources=SMALL,
                                        bundle="sha256:" + "0" * 64))
    # Anyone who may upload may write any name: a worker checks the bytes against it.
    forged_digest = "sha256:" + "1" * 64
    store = await nc.jetstream().object_store("BERTH_BUNDLES")
    await store.put(forged_digest, b"not the bundle that digest names")
    forged = await submit_job(nc, JobSpec(name="forged", command=["true"], resources=SMALL,
                                          bundle=forged_digest))
    failing = await submit_job(nc, JobSpec(
        name="badbuild", command=["echo", "never"], resources=SMALL, max_retries_failure=1,
        setup=["echo step one", "echo oops >&2; exit 3", "echo never reached"]))
    job = await wait_for_job(stack, str(failing.job_id), {"failed", "succeeded"})
    task = job["tasks"][0]
    assert [a["state"] for a in task["attempts"]] == ["failed", "failed"]  # the budget: 1 retry
    assert task["error"] == "build failed: echo oops >&2; exit 3 exited 3\nstep one\noops"
    assert "never" not in logs_of(stack, str(failing.job_id))
    job = await wait_for_job(stack, str(slow.job_id), {"failed", "succeeded"})
    assert job["tasks"][0]["error"] == "build failed: sleep 30 ran past the build_timeout of 1s"
    # A digest nobody uploaded: the attempt fails with the reason; nothing else is disturbed.
    job = await wait_for_job(stack, str(lost.job_id), {"failed", "succeeded"})
    assert job["tasks"][0]["error"] == (
        f"bundle sha256:{'0' * 64} is not in the object store (bucket BERTH_BUNDLES): "
        "submit it again")
    job = await wait_for_job(stack, str(forged.job_id), {"failed", "succeeded"})
    assert job["tasks"][0]["error"] == (
        f"bundle {forged_digest}: the object store's copy does not match its digest")
    # It waited for the slow build's slot (BERTH_MAX_BUILDS=1), staying assigned: its worker
    # said why (the task's pending_reason meanwhile), and its log says so too.
    slot = "waiting for a build slot: 1 builds at once on this worker (BERTH_MAX_BUILDS)"
    assert logs_of(stack, str(lost.job_id)) == slot + "\n"
    assert (S.ASSIGNED, slot) in await reports_of(nc, str(lost.job_id))
    job = await wait_for_job(stack, str(resumable.job_id), {"failed", "succeeded", "killed"})
    assert job["state"] == "succeeded"
    first, second = job["tasks"][0]["attempts"]
    assert first["state"] == "killed" and first["error"].startswith("timed out")
    assert second["state"] == "succeeded"
    assert "resumed from step 7 retry 1" in logs_of(stack, str(resumable.job_id))
    # Nothing to build: no BUILDING report, RUNNING straight after ASSIGNED. A setup to
    # run: BUILDING first, each attempt.
    assert S.BUILDING not in {s for s, _ in await reports_of(nc, str(resumable.job_id))}
    assert [s for s, _ in await reports_of(nc, str(failing.job_id))].count(S.BUILDING) == 2
    job = await wait_for_job(stack, str(no_budget.job_id), {"failed", "succeeded", "killed"})
    assert job["state"] == "killed" and len(job["tasks"][0]["attempts"]) == 1
    with caplog.at_level(logging.WARNING, logger="berth.worker.bundles"):
        cache = await bundle_cache_shares_fetches_repairs_and_evicts(nc, tmp_path)
    # Run as root over hard links, a worker says once what read-only does not stop.
    warned = [r for r in caplog.records if "tasks run as root" in r.getMessage()]
    assert len(warned) == (os.geteuid() == 0 and cache.placer.shares_files())


async def bundle_cache_shares_fetches_repairs_and_evicts(nc: NATS, tmp_path: Path
                                                        ) -> BundleCache:
    """A worker's cache, over the stack's object store (as the admin, who may read it)."""
    digests = []
    store = await nc.jetstream().object_store("BERTH_BUNDLES")
    for name, size in (("one", 300_000), ("two", 1_500_000)):
        root = make_tree(tmp_path / "trees" / name)
        (root / "which.txt").write_text(name)
        (root / "weights.bin").write_bytes(os.urandom(size))
        with tempfile.TemporaryFile() as archive:
            packed = bundles.pack(root, archive)
            if name == "one":  # as an older berth stored it: nats-py's 128 KiB chunks
                archive.seek(0)
                info = await store.put(packed.digest, archive.read())
                assert info.chunks == 3
            else:  # 1 MiB chunks
                assert (await workspace.upload(nc, archive, packed)).uploaded  # type: ignore[arg-type]
                assert (await store.get_info(packed.digest)).chunks == 2
        digests.append(packed.digest)
    one, two = digests
    cache = BundleCache(tmp_path / "cache", 1, nc.jetstream())  # a 1-byte cap
    tasks = [tmp_path / "tasks" / str(i) for i in range(4)]
    # Four attempts want it at once: one fetch and one unpack, shared by all.
    await asyncio.gather(*(cache.place(one, task) for task in tasks))
    assert cache.fetches == 1
    assert all((task / "which.txt").read_text() == "one" for task in tasks)
    # A write in place (as root, or after a chmod) is noticed, and the bundle fetched again.
    (tasks[0] / "which.txt").chmod(0o644)
    (tasks[0] / "which.txt").write_text("changed")
    await cache.place(one, tmp_path / "tasks" / "after")
    assert cache.fetches == 2
    assert (tmp_path / "tasks" / "after" / "which.txt").read_text() == "one"
    # Over the cap, the least recently used tree goes; the task directories keep its files.
    await cache.place(two, tmp_path / "tasks" / "two")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [two.split(":")[1]]
    assert (tmp_path / "tasks" / "after" / "which.txt").read_text() == "one"
    return cache


def test_quick_bundles_benchmark_runs_and_each_worker_fetches_a_bundle_once() -> None:
    """`bench/bundles.py --quick` end to end; its timings are the benchmark's to report."""
    done = subprocess.run([sys.executable, "bench/bundles.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["uploaded_bytes"] > 2 * 1024 * 1024
    assert result["same_tree_again_uploaded_bytes"] == 0
    assert result["fan_out_fetches"] == result["workers"] == 2


def test_quick_fetch_profile_runs_and_every_fetcher_gets_the_same_bytes() -> None:
    """`bench/bundle_fetch.py --quick`: the fan-out's fetches apart from the stack."""
    done = subprocess.run([sys.executable, "bench/bundle_fetch.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["how"] for r in results] == ["ordered", "stream"]
    for result in results:  # a 1 MiB bundle's tar: 9 chunks of 128 KiB
        assert result["intact"] and result["chunks"] == 9 and len(result["wall_s"]) == 2
