"""Job constraints against worker attributes: pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from berth.shared.messages import Constraint, ConstraintMode, Op, parse_number


def holds(attributes: Mapping[str, str], c: Constraint) -> bool:
    have = attributes.get(c.key)
    match c.op:
        case Op.EXISTS:
            return have is not None
        case Op.NOT_EXISTS:
            return have is None
        case Op.EQ:
            return have is not None and have == c.value
        case Op.NE:
            return have != c.value  # a worker without the attribute is not equal to it
        case Op.IN:
            return have is not None and have in (c.values or [])
    left, right = parse_number(have), parse_number(c.value)
    if left is None or right is None:
        return False  # a missing or non-numeric attribute satisfies no comparison
    match c.op:
        case Op.GT:
            return left > right
        case Op.GE:
            return left >= right
        case Op.LT:
            return left < right
        case _:
            return left <= right


def required(constraints: Sequence[Constraint]) -> list[Constraint]:
    return [c for c in constraints if c.mode == ConstraintMode.REQUIRED]


def matches(attributes: Mapping[str, str], constraints: Sequence[Constraint]) -> bool:
    """Every required constraint must hold; preferred ones never rule a worker out."""
    return all(holds(attributes, c) for c in constraints if c.mode == ConstraintMode.REQUIRED)


def preference(attributes: Mapping[str, str], constraints: Sequence[Constraint]) -> int:
    """How many of the preferred constraints hold: the higher, the better the worker. A
    count, not a weight: each preference is worth the same, so a job need not tune any."""
    return sum(1 for c in constraints
               if c.mode == ConstraintMode.PREFERRED and holds(attributes, c))


def describe(constraints: Sequence[Constraint]) -> str:
    parts = []
    for c in constraints:
        if c.op in (Op.EXISTS, Op.NOT_EXISTS):
            parts.append(f"{c.key} {c.op.value}")
        elif c.op == Op.IN:
            parts.append(f"{c.key} IN [{', '.join(c.values or [])}]")
        else:
            parts.append(f"{c.key} {c.op.value} {c.value}")
    return ", ".join(parts)
