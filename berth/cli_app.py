"""The frame of the `berth` command: the Typer app every command module registers on, the
global options and where each is read, and how output and failures are said. A module adds
its commands with a `register(app)` that berth/cli.py calls."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from berth.shared import config
from berth.stack_info import nats_url, read_stack_info

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_API_URL = "http://127.0.0.1:8080"

# The root's options that take a value; accepted after the subcommand too (`berth status
# --api-url X`), where hoist_global_options moves them in front of it.
GLOBAL_OPTIONS = ("--data-dir", "--nats-url", "--api-url", "--profile")


@dataclass(frozen=True)
class Globals:
    """What every command may need: where the data dir is, and the URLs as flags gave them."""

    data_dir: str
    nats_url_flag: str | None = None
    api_url_flag: str | None = None

    def nats_url(self) -> str:
        """Its flag, then BERTH_NATS_URL or the profile's, then a running `berth up`'s."""
        return nats_url(self.nats_url_flag, self.data_dir)

    def api_url(self) -> str:
        """Its flag, then BERTH_API_URL or the profile's, then a running `berth up`'s."""
        return self.api_url_flag or config.cli_api_url() or str(
            read_stack_info(self.data_dir).get("api_url", DEFAULT_API_URL))


def globals_of(ctx: typer.Context) -> Globals:
    obj = ctx.find_root().obj
    assert isinstance(obj, Globals), "the root callback sets it"
    return obj


def hoist_global_options(argv: Sequence[str], verbatim: Collection[str]) -> list[str]:
    """`argv` with each global option (and its value) found after the subcommand moved in
    front of it, where the root parses it. Arguments after `--`, and those of a subcommand
    in `verbatim` (which passes them on as they are), stay where they are."""
    front: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # the root's own, already in front
        takes_value = argv[i] in GLOBAL_OPTIONS
        front += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    if i >= len(argv) or argv[i] in verbatim:
        return list(argv)
    rest: list[str] = []
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg.split("=", 1)[0] in GLOBAL_OPTIONS:
            takes_value = "=" not in arg
            front += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
        else:
            rest.append(arg)
            i += 1
    return front + rest


def fail(message: str, code: int = 1) -> NoReturn:
    """Says what went wrong in one line on stderr, and ends the command with `code`."""
    print(f"berth: {message}", file=sys.stderr)
    raise typer.Exit(code)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def console(stderr: bool = False) -> Console:
    """A Rich console; into a pipe or file it does not wrap lines at 80 columns."""
    # Rich is imported here, by the commands that draw, not by every `berth` command.
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # Rich would exit with status 1; the root command ends as a SIGPIPE would.
            raise BrokenPipeError

    stream = sys.stderr if stderr else sys.stdout
    return _Console(file=stream, width=None if stream.isatty() else 200, highlight=False)


JsonFlag = Annotated[bool, typer.Option("--json", help="print JSON (for scripts)")]


class _Root(TyperGroup):
    """The root command group: a reader that went away (`berth status | head -1`) ends the
    command quietly, as a SIGPIPE would."""

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # here, where a closed pipe can still be caught
            return result
        except BrokenPipeError:
            # Keep Python from complaining as it flushes stdout on exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise typer.Exit(128 + signal.SIGPIPE) from None


def new_app() -> typer.Typer:
    return typer.Typer(
        name="berth", cls=_Root, no_args_is_help=True, rich_markup_mode=None,
        pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
        help="berth: a cluster job scheduler. Start a local cluster with `berth up`, submit "
        "with `berth submit job.yaml`, watch with `berth watch JOB`. Global options may also "
        "follow the command; defaults come from BERTH_* variables, then the profile of "
        f"the config file ({config.cli_config_path()}), then a running `berth up`.")
