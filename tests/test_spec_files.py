"""Spec files as a careless user writes them: JSON parsed as JSON, YAML by YAML 1.2's core
schema (PyYAML alone is YAML 1.1), duplicate keys refused with the key named, and every
failure one line, never a traceback."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from berth.spec_files import SpecFileError, load_spec, parse_yaml


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("5e-1", 0.5), ("1e3", 1000.0), ("-2.5E+2", -250.0), (".5", 0.5), ("1.", 1.0),
        ("017", 17), ("0o17", 15), ("0x1F", 31), ("+5", 5), ("-3", -3),
        ("yes", "yes"), ("no", "no"), ("on", "on"), ("off", "off"), ("y", "y"),
        ("true", True), ("False", False), ("~", None), ("null", None), ("", None),
        ("1:30", "1:30"), ("2024-01-01", "2024-01-01"), ("1_000", "1_000"),
        ("'5e-1'", "5e-1"), ("0.1.2", "0.1.2"),
    ],
)
def test_plain_scalars_resolve_as_yaml_1_2(text: str, value: Any) -> None:
    assert parse_yaml(f"x: {text}\n", "f.yaml") == {"x": value}


def test_anchors_and_merge_keys_still_work() -> None:
    doc = "base: &b {cpu: 0.5, disk_mb: 1}\nresources:\n  <<: *b\n  memory_mb: 64\n  cpu: 2\n"
    assert parse_yaml(doc, "f.yaml")["resources"] == {"cpu": 2, "disk_mb": 1, "memory_mb": 64}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("job.yaml", "name: a\ncommand: [x]\nname: b\n",
         "job.yaml: not valid YAML: duplicate key 'name' (line 3, first given on line 1)"),
        ("job.yaml", "name: a\nenv: {A: 1, A: 2}\n", "duplicate key 'A'"),
        ("job.json", '{"name": "a", "name": "b"}', "job.json: not a valid JSON spec: "
         "duplicate key 'name'"),
        ("job.json", "name: a\ncommand: [x]\n", "job.json: not valid JSON: Expecting value"),
        ("job.yaml", "a: b: c\n", "job.yaml: not valid YAML: mapping values are not allowed"),
        ("job.yaml", "x: " + "[" * 5000 + "]" * 5000, "nested too deeply"),
        ("job.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_bad_files_are_one_line_naming_the_problem(tmp_path: Path, name: str, text: str,
                                                   message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SpecFileError) as refused:
        load_spec(str(path))
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_json_file_is_json(tmp_path: Path) -> None:
    """YAML 1.1 would read this JSON's 5e-1 as a string: as JSON it is a number."""
    path = tmp_path / "job.json"
    path.write_text('{"name": "a", "command": ["x"], "resources": {"cpu": 5e-1}}')
    assert json.loads(load_spec(str(path)))["resources"] == {"cpu": 0.5}
    yaml_path = tmp_path / "job.yaml"
    yaml_path.write_text("name: a\ncommand: [x]\nresources: {cpu: 5e-1}\n")
    assert json.loads(load_spec(str(yaml_path)))["resources"] == {"cpu": 0.5}


@pytest.mark.parametrize(
    ("stdin", "expected"),
    [
        (b'{"name": "a", "command": ["x"]}', {"name": "a", "command": ["x"]}),
        (b"name: a\ncommand: [x]\n", {"name": "a", "command": ["x"]}),
    ],
)
def test_dash_reads_standard_input_as_json_or_yaml(
        monkeypatch: pytest.MonkeyPatch, stdin: bytes, expected: dict[str, Any]) -> None:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert json.loads(load_spec("-")) == expected


def test_not_utf8_and_too_large_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(b"name: \xff\n")
    with pytest.raises(SpecFileError, match="not UTF-8 text"):
        load_spec(str(path))
    path.write_bytes(b"#" * (5 * 1024 * 1024))
    with pytest.raises(SpecFileError, match="larger than"):
        load_spec(str(path))
