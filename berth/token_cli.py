"""`berth token`: minting, listing and revoking the dashboard API's bearer tokens (the
tokens file of shared/api_tokens.py, which a running dashboard re-reads when it changes)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shared import api_tokens
from shared.config import api_tokens_file


def _path(args: argparse.Namespace) -> Path:
    return Path(api_tokens_file(args.data_dir))


def cmd_token_create(args: argparse.Namespace) -> int:
    path = _path(args)
    try:
        token = api_tokens.create(path, args.name, api_tokens.Role(args.role))
    except (ValueError, api_tokens.TokensFileError, OSError) as exc:
        print(f"berth: {exc}", file=sys.stderr)
        return 1
    print(f"token for {args.name} (role {args.role}) added to {path}; it is shown only this "
          "once:", file=sys.stderr)
    print(token)
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    try:
        records = api_tokens.load(_path(args)).tokens
    except api_tokens.TokensFileError as exc:
        print(f"berth: {exc}", file=sys.stderr)
        return 1
    for r in sorted(records, key=lambda r: r.name):
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created_at))
        print(f"{r.name:<24} {r.role.value:<8} {created}")
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    try:
        api_tokens.revoke(_path(args), args.name)
    except (ValueError, api_tokens.TokensFileError, OSError) as exc:
        print(f"berth: {exc}", file=sys.stderr)
        return 1
    print(f"token of {args.name} revoked", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "token", help="mint, list and revoke dashboard API tokens",
        description="Dashboard API tokens, each with an identity and a role: read (reads), "
        "submit (reads; submits and cancels its own jobs), admin (everything). Kept as "
        "SHA-256 hashes in <data dir>/auth/api-tokens.json (or $BERTH_API_TOKENS_FILE); a "
        "running dashboard picks up changes at once.")
    tokens = p.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    t = tokens.add_parser("create", help="mint a token for NAME and print it (once)")
    t.add_argument("name", help="the identity: 1-64 letters, digits, '_' or '-'")
    t.add_argument("--role", choices=[r.value for r in api_tokens.Role], default="read",
                   help="default: read")
    t.set_defaults(func=cmd_token_create)
    t = tokens.add_parser("list", help="names and roles (never the tokens)")
    t.set_defaults(func=cmd_token_list)
    t = tokens.add_parser("revoke", help="remove NAME's token")
    t.add_argument("name")
    t.set_defaults(func=cmd_token_revoke)
