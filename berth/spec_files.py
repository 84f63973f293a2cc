"""Reading a job spec file (or stdin) into the JSON bytes of a submit message: JSON as JSON,
YAML as YAML 1.2 (its core schema). Validation is the submitter's; this only converts the
format, and says in one line what is wrong when it cannot.

PyYAML implements YAML 1.1, whose surprises reach a job spec: `5e-1` is a string (1.1's
floats need a dot), `yes`/`no`/`on`/`off` are booleans, `1:30` is 90, `017` is octal 15, a
date is a date object, and a key given twice silently keeps the last value. The loader here
resolves plain scalars by the YAML 1.2 core schema instead, and refuses duplicate keys
(docs/decisions.md)."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import msgspec
import yaml

# Larger than any submit the submitter accepts (BERTH_MAX_SUBMIT_BYTES), so a bigger file is
# refused here without being parsed.
MAX_FILE_BYTES = 4 * 1024 * 1024


class SpecFileError(ValueError):
    """The file cannot be read as a spec; the message is one line naming where and why."""


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema's implicit types, and no duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False
                          ) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: its keys may be overridden, so not duplicates
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key; the base class says so
                break
            if first is not None:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {mark.line + 1}, first given on "
                    f"line {first.start_mark.line + 1})", mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep)


def _int12(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if text[:2] == "0o":
        return int(text[2:], 8)
    if text[:2] == "0x":
        return int(text[2:], 16)
    return int(text, 10)  # "017" is 17 in YAML 1.2, not octal


def _float12(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = str(loader.construct_scalar(node)).lower()
    sign = -1.0 if text.startswith("-") else 1.0
    bare = text.lstrip("+-")
    if bare == ".inf":
        return sign * float("inf")
    if bare == ".nan":
        return float("nan")
    return float(text)


# The YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution), plus the
# merge key `<<` that anchors in spec files use.
_Yaml12Loader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$",
     list("-+0123456789")),
    ("tag:yaml.org,2002:float",
     r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
     r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", list("-+0123456789.")),
    ("tag:yaml.org,2002:merge", r"^(?:<<)$", ["<"]),
):
    _Yaml12Loader.add_implicit_resolver(_tag, re.compile(_pattern), _first)
_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _int12)
_Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _float12)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SpecFileError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except SpecFileError as exc:
        raise SpecFileError(f"{where}: not a valid JSON spec: {exc}") from None
    except json.JSONDecodeError as exc:
        raise SpecFileError(f"{where}: not valid JSON: {exc}") from None
    except RecursionError:
        raise SpecFileError(f"{where}: not a valid JSON spec: nested too deeply") from None


def parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise SpecFileError(f"{where}: not valid YAML: {_one_line(exc)}") from None
    except RecursionError:
        raise SpecFileError(f"{where}: not a valid YAML spec: nested too deeply") from None


def _one_line(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        text = f"{exc.context} and {exc.problem}" if exc.context else exc.problem
        mark = exc.problem_mark
        if mark is not None and "(line " not in text:
            text += f" (line {mark.line + 1}, column {mark.column + 1})"
        return " ".join(text.split())
    return " ".join(str(exc).split())


def load_spec(path: str) -> bytes:
    """The spec in `path` ("-": standard input) as the JSON bytes of a submit message.
    A `.json` file is JSON; a `.yaml`/`.yml` (or any other) file is YAML 1.2; standard
    input is JSON if it parses as JSON, else YAML. Raises SpecFileError or OSError."""
    where = "standard input" if path == "-" else path
    if path == "-":
        raw = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
    else:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise SpecFileError(f"{where}: larger than {MAX_FILE_BYTES} bytes; no submit can be")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecFileError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                            ) from None
    if path.lower().endswith(".json"):
        data = parse_json(text, where)
    elif path == "-":
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except (ValueError, RecursionError):
            data = parse_yaml(text, where)
    else:
        data = parse_yaml(text, where)
    try:
        return msgspec.json.encode(data)
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. .inf or a date-like tag
        raise SpecFileError(f"{where}: cannot be sent as JSON: {exc}") from None
