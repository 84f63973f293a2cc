"""The spec file's client-side fields, resolved before a submit: `workspace` (a directory
packed into a bundle and uploaded to the object store; the submit carries its digest as
`bundle`) and `env_file` (KEY=VALUE lines merged under the spec's `env`). Paths are relative
to the spec file's directory (the current directory for standard input)."""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import dotenv
from nats.aio.client import Client as NATS
from nats.js.api import ObjectMeta, ObjectMetaOptions
from nats.js.errors import NotFoundError

from berth.shared import bundles, config, subjects


@dataclass(frozen=True)
class Upload:
    digest: str
    files: int
    size: int
    uploaded: int  # bytes sent: 0 when the object store already had the bundle


def client_fields(payload: bytes) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """The spec as a dict with `workspace` and `env_file` taken out, and those two; (None,
    None, None) when the spec names neither (it is then sent as it is)."""
    try:
        spec = json.loads(payload)
    except ValueError:
        return None, None, None
    if not isinstance(spec, dict) or not ({"workspace", "env_file"} & spec.keys()):
        return None, None, None
    workspace, env_file = spec.pop("workspace", None), spec.pop("env_file", None)
    for name, value in (("workspace", workspace), ("env_file", env_file)):
        if value is not None and (not isinstance(value, str) or not value):
            raise bundles.BundleError(f"{name}: expected a path, got {value!r}")
    return spec, workspace, env_file


def needs_resolving(payload: bytes) -> bool:
    return client_fields(payload)[0] is not None


def with_workspace(payload: bytes, workspace: str | None) -> bytes:
    """The spec with `workspace` set from the command line (which wins over the file's)."""
    if workspace is None:
        return payload
    try:
        spec = json.loads(payload)
    except ValueError:
        return payload  # the submitter says what is wrong with it
    if not isinstance(spec, dict):
        return payload
    # A path given on the command line is the shell's, not relative to the spec file.
    spec["workspace"] = str(Path(workspace).absolute())
    return json.dumps(spec).encode()


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (the .env format: comments, quotes, `export`), read by python-dotenv."""
    if not path.is_file():
        raise bundles.BundleError(f"env_file {str(path)!r}: no such file")
    values = dotenv.dotenv_values(path, interpolate=False)
    missing = [key for key, value in values.items() if value is None]
    if missing:
        raise bundles.BundleError(f"env_file {str(path)!r}: {missing[0]!r} has no value "
                                  "(expected KEY=VALUE)")
    return {key: value for key, value in values.items() if value is not None}


async def upload(nc: NATS, archive: BinaryIO, packed: bundles.Packed) -> Upload:
    """Stores a packed bundle in the bundles bucket unless it is there already."""
    size = archive.seek(0, io.SEEK_END)
    try:
        store = await nc.jetstream().object_store(subjects.BUNDLES_BUCKET)
    except NotFoundError:
        raise bundles.BundleError(
            f"the NATS server has no {subjects.BUNDLES_BUCKET} object store (is berth "
            "running there?)") from None
    name = bundles.object_name(packed.digest)
    try:
        await store.get_info(name)
        return Upload(packed.digest, packed.files, packed.size, 0)
    except NotFoundError:
        pass
    archive.seek(0)
    chunk = min(bundles.UPLOAD_CHUNK_BYTES, nc.max_payload)
    meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=chunk))
    await store.put(name, archive, meta=meta)  # type: ignore[arg-type]
    return Upload(packed.digest, packed.files, packed.size, size)


async def resolve(payload: bytes, base: Path, connect: Callable[[], AsyncContextManager[NATS]],
                  log: Callable[[str], object]) -> bytes:
    """The submit bytes with `workspace` and `env_file` resolved: everything that can be
    wrong with them is found before `connect()` is called to upload the bundle; `log(line)`
    hears what was uploaded. Raises BundleError (one line)."""
    spec, workspace, env_file = client_fields(payload)
    if spec is None:
        return payload
    if env_file is not None:
        env = read_env_file(base / env_file)
        given = spec.get("env")
        if isinstance(given, dict):
            env.update(given)
        spec["env"] = env
    if workspace is not None:
        if "bundle" in spec:
            raise bundles.BundleError("workspace: give either workspace or bundle, not both")
        with tempfile.TemporaryFile(prefix="berth-bundle-") as archive:
            packed = bundles.pack(base / workspace, archive, config.bundle_max_bytes())
            async with connect() as nc:
                done = await upload(nc, archive, packed)
        spec["bundle"] = done.digest
        sent = (f"uploaded {bundles.mib(done.uploaded)}" if done.uploaded
                else "already stored, uploaded 0 bytes")
        log(f"bundle {done.digest} ({done.files} files, {bundles.mib(done.size)}): {sent}")
    return json.dumps(spec).encode()
