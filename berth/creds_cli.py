"""`berth creds`: making, listing and revoking the identities that may use the bus, and
which identity the `berth` command itself speaks as."""

from __future__ import annotations

import contextlib
import getpass
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from berth.cli_app import JsonFlag, globals_of, print_json
from berth.shared import config
from berth.shared.credentials import (
    NAME_PATTERN,
    AuthDir,
    Credentials,
    CredentialsError,
    Role,
    describe,
    identity_name,
    load,
    write_private,
)
from berth.stack_info import read_stack_info

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

# berth.shared.servers (and through it Redis and OpenTelemetry) is imported by the commands that
# render or reload the servers' config, not by every `berth` command.

ROLES_WITH_SCOPE = {"worker": Role.WORKER, "user": Role.SUBMIT}


def local_user() -> str | None:
    """The login name, if it can be a berth user name as it is."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        return None
    return name if NAME_PATTERN.match(name) else None


def cli_credentials(data_dir: str, admin: bool = False) -> Credentials:
    """Who the `berth` command is on the bus: BERTH_NATS_CREDS if set; else, beside a local
    `berth up`, the local user (or, for `admin`, the admin identity) it made."""
    given = config.cli_nats_creds()
    auth = _local_auth(Path(data_dir).resolve())
    candidates = [Path(given)] if given else []
    user = local_user()
    if not given:
        if user and not admin:
            candidates.append(auth.creds_path(identity_name(Role.SUBMIT, user)))
        candidates.append(auth.creds_path(identity_name(Role.ADMIN)))
    for path in candidates:
        if given or path.exists():
            try:
                return load(path)
            except CredentialsError as exc:
                raise SystemExit(f"berth: {exc}") from None
    raise SystemExit(
        f"berth: no NATS credentials: none in {auth.path} (is `berth up` running there?); "
        "set BERTH_NATS_CREDS to a file made by `berth creds user NAME`")


@contextlib.asynccontextmanager
async def cli_connection(nats_url: str, creds: Credentials) -> AsyncIterator[NATS]:
    """A NATS connection for one command, as `creds`; an unreachable server or a refused
    identity is a clear exit."""
    import nats

    from berth.shared.config import Settings
    from berth.shared.nats_io import auth_options, server_urls, settings_tls, tls_options

    refused: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        refused.append(exc)

    try:
        nc = await nats.connect(server_urls(nats_url), connect_timeout=5,
                                max_reconnect_attempts=2, error_cb=on_error,
                                **auth_options(creds),
                                **tls_options(settings_tls(Settings.from_env())))
    except Exception as exc:
        why = refused[-1] if refused else exc
        raise SystemExit(f"berth: cannot use NATS at {nats_url} as {creds.name}: {why}"
                         ) from None
    try:
        yield nc
    finally:
        await nc.close()


def _local_auth(data_dir: Path) -> AuthDir:
    """The auth folder of the `berth up` running in `data_dir` (its servers may keep theirs
    elsewhere), or the data dir's own."""
    auth_dir = read_stack_info(data_dir).get("auth_dir")
    return AuthDir(Path(auth_dir)) if isinstance(auth_dir, str) else AuthDir.of(data_dir)


def _running_nats_pids(data_dir: Path) -> list[int]:
    """The nats-servers of the `berth up` running in `data_dir` (every node of its cluster)
    that are still running."""
    from berth.shared import servers

    try:
        info = read_stack_info(data_dir)
        pids = [int(pid) for pid in info.get("nats_pids") or [info["nats_pid"]]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [pid for pid in pids if servers.is_nats_server(pid)]


def _apply(data_dir: Path, auth: AuthDir) -> None:
    """Renders the server's users and, beside a local `berth up`, reloads its nats-servers
    (no restart: connected clients stay connected)."""
    from berth.shared import servers

    users = servers.write_nats_users(auth)
    pids = _running_nats_pids(data_dir)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended since it was looked at
            servers.reload_nats(pid)
    if pids:
        print(f"nats-server (pid {', '.join(map(str, pids))}) reloaded with {users}",
              file=sys.stderr)
    else:
        print(f"wrote {users}: copy it to every nats-server's config folder and reload "
              "them (`nats-server --signal reload`)", file=sys.stderr)


ROUTES_FILE = "cluster-routes.conf"


def _routes(auth: AuthDir, addresses: str) -> int:
    """Renders the routes file every node of a NATS cluster on real hosts includes in its
    `cluster {}` (deploy/nats-cluster.conf): the route secret of this auth folder (made
    once) and a route to each `host:port`."""
    from berth.shared import servers

    routes = [a.strip() for a in addresses.split(",") if a.strip()]
    if not routes or any(":" not in r or "@" in r or "/" in r for r in routes):
        print("berth: `berth creds routes` needs the nodes' route addresses, comma-separated: "
              "nats-1:6222,nats-2:6222,nats-3:6222", file=sys.stderr)
        return 2
    path = auth.path / ROUTES_FILE
    write_private(path, servers.routes_config(servers.RouteAuth.of(auth), routes).encode())
    print(f"wrote {path}: copy it beside nats-cluster.conf on every node (mode 0640, owner "
          "root, group nats) and reload them; it holds the route password", file=sys.stderr)
    print(path)
    return 0


Action = Literal["worker", "user", "scheduler", "submitter", "dashboard", "admin", "list",
                 "revoke", "routes"]


def cmd_creds(
    ctx: typer.Context,
    action: Annotated[Action, typer.Argument(
        help="the role to make credentials for, or list / revoke / routes")],
    name: Annotated[str, typer.Argument(
        help="worker id (worker), user name (user), identity (revoke), the nodes' route "
        "addresses host:port, comma-separated (routes)")] = "",
    as_json: JsonFlag = False,
) -> int:
    """Make, list or revoke identities on the bus (NATS credentials).

    Every connection to berth's NATS is an identity with one role, and nats-server lets
    each role publish and read only its own subjects. `berth creds worker HOST` makes the
    credentials file for one worker host (it may report only as HOST and receive only
    HOST's commands); `berth creds user NAME` one for a user who submits jobs (which are
    then NAME's, and only NAME may cancel them). Beside a running `berth up` the NATS server
    is reloaded at once; elsewhere, copy the rendered users file to the servers and reload
    them. `berth creds routes nats-1:6222,nats-2:6222,nats-3:6222` renders the routes file
    of a NATS cluster (its route password, made once, and the routes;
    docs/nats-cluster.md)."""
    data_dir = Path(globals_of(ctx).data_dir).resolve()
    auth = _local_auth(data_dir)
    try:
        if action == "routes":
            return _routes(auth, name)
        if action == "list" and as_json:
            # The public half only, as the identities file holds it: never a seed.
            print_json([{"name": i.name, "role": i.role.value, "scope": i.scope,
                         "public_key": i.public_key} for i in auth.identities()])
            return 0
        if action == "list":
            for identity in auth.identities():
                scope = f" ({identity.scope})" if identity.scope else ""
                print(f"{identity.name:<32} {identity.role}{scope}")
            return 0
        if action == "revoke":
            if not auth.revoke(name):
                print(f"berth: no identity {name!r} (see `berth creds list`)",
                      file=sys.stderr)
                return 1
            _apply(data_dir, auth)
            print(f"revoked {name}", file=sys.stderr)
            return 0
        role = ROLES_WITH_SCOPE.get(action) or Role(action)
        scope = name if action in ROLES_WITH_SCOPE else ""
        if action in ROLES_WITH_SCOPE and not scope:
            print(f"berth: `berth creds {action}` needs a name", file=sys.stderr)
            return 2
        existed = auth.creds_path(identity_name(role, scope)).exists()
        creds = auth.ensure(role, scope)
        if not existed:
            _apply(data_dir, auth)
    except CredentialsError as exc:
        print(f"berth: {exc}", file=sys.stderr)
        return 2
    path = auth.creds_path(creds.name)
    print(f"{'kept' if existed else 'made'} {describe(creds)}: {path}", file=sys.stderr)
    print("give that file to the host that runs it, readable only by its service user, and "
          "point BERTH_NATS_CREDS at it", file=sys.stderr)
    print(path)
    return 0


def register(app: typer.Typer) -> None:
    app.command("creds")(cmd_creds)
