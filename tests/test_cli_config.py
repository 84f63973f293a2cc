"""The `berth` command's settings: global flags after the command, the config file's
profiles beside the BERTH_* variables, and how a bad one is said (one line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from berth import cli
from berth.cli_app import hoist_global_options
from berth.shared import config


@pytest.mark.parametrize(("argv", "parsed"), [
    (["status", "--api-url", "X", "j1"], ["--api-url", "X", "status", "j1"]),
    (["--data-dir", "d", "logs", "j1", "--api-url=X", "-f"],
     ["--data-dir", "d", "--api-url=X", "logs", "j1", "-f"]),
    (["token", "create", "ada", "--data-dir", "d"], ["--data-dir", "d", "token", "create", "ada"]),
    # `run` passes its arguments on: a worker's --nats-url is the worker's.
    (["run", "worker", "--nats-url", "N"], ["run", "worker", "--nats-url", "N"]),
    (["submit", "-", "--", "--api-url"], ["submit", "-", "--", "--api-url"]),
    (["--version"], ["--version"]),
])
def test_global_options_after_the_command_move_in_front(argv: list[str],
                                                        parsed: list[str]) -> None:
    assert hoist_global_options(argv, cli.VERBATIM) == parsed


CONFIG = """
default_profile = "lab"
[profiles.lab]
api_url = "http://lab:8080"
nats_url = "nats://lab:4222"
nats_creds = "~/lab.creds"
[profiles.prod]
api_url = "http://prod:8080"
"""


def test_profiles_give_settings_the_environment_overrides(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.toml"
    path.write_text(CONFIG)
    monkeypatch.setenv("BERTH_CONFIG", str(path))
    for name in ("BERTH_API_URL", "BERTH_NATS_URL", "BERTH_NATS_CREDS", "BERTH_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config.select_cli_profile(None)  # the file's default_profile
    assert config.cli_api_url() == "http://lab:8080"
    assert config.cli_nats_creds() == str(Path("~/lab.creds").expanduser())
    monkeypatch.setenv("BERTH_PROFILE", "prod")
    config.select_cli_profile(None)
    assert config.cli_api_url() == "http://prod:8080" and config.cli_nats_url() is None
    config.select_cli_profile("lab")  # --profile beats BERTH_PROFILE
    assert config.cli_nats_url() == "nats://lab:4222"
    monkeypatch.setenv("BERTH_API_URL", "http://env:1")
    assert config.cli_api_url() == "http://env:1"


@pytest.mark.parametrize(("text", "profile", "says"), [
    ("[profiles.lab]\napi_ur = 'x'\n", None, "profiles.lab.api_ur: not a setting"),
    ("[profiles.default]\napi_url = 3\n", None, "profiles.default.api_url: must be a "
     "non-empty string"),
    ("[profiles.lab]\n", "prod", "profile 'prod': not in the file (it has lab)"),
    ("[profiles\n", None, "Expected ']'"),
])
def test_a_bad_config_file_is_one_line_naming_the_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        text: str, profile: str | None, says: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    monkeypatch.setenv("BERTH_CONFIG", str(path))
    argv = ["schema", *(["--profile", profile] if profile else [])]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err


def test_version_and_a_usage_error_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("berth ")
    assert cli.main(["logs"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "berth logs: Missing argument 'job'. (see `berth logs --help`)"
