"""`berth token`: minting, listing and revoking the dashboard API's bearer tokens (the
tokens file of shared/api_tokens.py, which a running dashboard re-reads when it changes)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from berth.cli_app import JsonFlag, fail, globals_of, print_json
from berth.shared import api_tokens
from berth.shared.config import api_tokens_file

tokens = typer.Typer(
    name="token", no_args_is_help=True,
    help="Mint, list and revoke dashboard API tokens.\n\nDashboard API tokens, each with an "
    "identity and a role: read (reads), submit (reads; submits and cancels its own jobs), "
    "admin (everything). Kept as SHA-256 hashes in <data dir>/auth/api-tokens.json (or "
    "$BERTH_API_TOKENS_FILE); a running dashboard picks up changes at once.")


def _path(ctx: typer.Context) -> Path:
    return Path(api_tokens_file(globals_of(ctx).data_dir))


@tokens.command("create")
def cmd_token_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="the identity: 1-64 letters, digits, '_' or '-'")],
    role: Annotated[api_tokens.Role, typer.Option(help="what the token may do")]
    = api_tokens.Role.READ,
) -> int:
    """Mint a token for NAME and print it (once)."""
    path = _path(ctx)
    try:
        token = api_tokens.create(path, name, role)
    except (ValueError, api_tokens.TokensFileError, OSError) as exc:
        fail(str(exc))
    print(f"token for {name} (role {role.value}) added to {path}; it is shown only this "
          "once:", file=sys.stderr)
    print(token)
    return 0


@tokens.command("list")
def cmd_token_list(ctx: typer.Context, as_json: JsonFlag = False) -> int:
    """Names and roles (never the tokens)."""
    try:
        records = sorted(api_tokens.load(_path(ctx)).tokens, key=lambda r: r.name)
    except api_tokens.TokensFileError as exc:
        fail(str(exc))
    if as_json:
        print_json([{"name": r.name, "role": r.role.value, "created_at": r.created_at}
                    for r in records])
        return 0
    for r in records:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created_at))
        print(f"{r.name:<24} {r.role.value:<8} {created}")
    return 0


@tokens.command("revoke")
def cmd_token_revoke(ctx: typer.Context, name: Annotated[str, typer.Argument()]) -> int:
    """Remove NAME's token."""
    try:
        api_tokens.revoke(_path(ctx), name)
    except (ValueError, api_tokens.TokensFileError, OSError) as exc:
        fail(str(exc))
    print(f"token of {name} revoked", file=sys.stderr)
    return 0


def register(app: typer.Typer) -> None:
    app.add_typer(tokens)
