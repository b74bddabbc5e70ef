"""Specs whose ``msgspec.Meta`` bounds hold on direct construction too, and the number types they use."""

from __future__ import annotations

import math
import types
import typing
from functools import cache
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from flowrl.errors import ConfigError
from flowrl.specs import Spec

GiB = 1024**3

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(gt=0, le=1)]
Count = Annotated[int, Meta(ge=1)]


# ------------------------------------------------------------------ checked specs


class SpecFieldError(ConfigError, ValueError):
    """A field is out of range. A ConfigError for callers; a ValueError so that msgspec, when it
    raises this from ``__post_init__`` while converting a document, reports the field's path."""


class CheckedSpec(Spec):
    """Base of the planner specs: ``msgspec.Meta`` bounds are enforced on direct construction too.

    msgspec checks ``Annotated[..., Meta(ge=...)]`` bounds only when decoding/converting; this
    ``__post_init__`` applies the same bounds (also to list items) when code builds a spec.
    Subclasses with cross-field rules override ``__post_init__`` and call ``super()``.
    """

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for name, bounds, item_bounds in _bounds(type(self)):
            value = getattr(self, name)
            if value is None:
                continue
            if bounds:
                _check_bounds(value, bounds, f"{kind} field '{name}'")
            if item_bounds and isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    _check_bounds(item, item_bounds, f"{kind} field '{name}[{i}]'")


def _check_bounds(value: Any, bounds: dict[str, float], where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # a type error; msgspec reports those when converting
    ops = {
        "gt": (lambda v, b: v > b, ">"),
        "ge": (lambda v, b: v >= b, ">="),
        "lt": (lambda v, b: v < b, "<"),
        "le": (lambda v, b: v <= b, "<="),
    }
    for key, bound in bounds.items():
        ok, sign = ops[key]
        if not ok(value, bound) or (isinstance(value, float) and math.isnan(value)):
            raise SpecFieldError(f"{where} must be {sign} {bound:g}, got {value!r}")


def _meta_bounds(tp: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    if typing.get_origin(tp) is Annotated:
        for meta in tp.__metadata__:
            if isinstance(meta, Meta):
                out.update({k: getattr(meta, k) for k in ("gt", "ge", "lt", "le") if getattr(meta, k) is not None})
    return out


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


@cache
def _bounds(cls: type) -> list[tuple[str, dict[str, float], dict[str, float]]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for name in cls.__struct_fields__:
        tp = _strip_optional(hints[name])
        item = None
        base = typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp
        if typing.get_origin(base) in (list, tuple) and typing.get_args(base):
            item = typing.get_args(base)[0]
        bounds, item_bounds = _meta_bounds(tp), _meta_bounds(item) if item is not None else {}
        if bounds or item_bounds:
            out.append((name, bounds, item_bounds))
    return out


def coerce_numbers(data: Any, tp: Any) -> Any:
    """Read number-like strings in a document as the numbers a spec field wants.

    YAML 1.1 reads ``312e12`` (no dot) as a string and users write ``memory_bytes: 80e9``; both
    are meant as numbers. Only values whose target field is an int/float are touched; integral
    floats become ints for int fields. Recurses into struct fields and tagged unions.
    """
    base = typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp
    base = _strip_optional(base)
    if base in (int, float) and not isinstance(data, bool):
        number = data
        if isinstance(data, str):
            try:
                number = float(data.strip().replace("_", ""))
            except ValueError:
                return data
        if base is int and isinstance(number, float):
            return int(number) if number.is_integer() else data
        return number if isinstance(number, (int, float)) else data
    if isinstance(data, list) and typing.get_origin(base) is list and typing.get_args(base):
        return [coerce_numbers(v, typing.get_args(base)[0]) for v in data]
    if isinstance(data, dict):
        if typing.get_origin(base) in (typing.Union, types.UnionType):
            for member in typing.get_args(base):
                info = _struct_info(member)
                if info and info.tag_field and data.get(info.tag_field) == info.tag:
                    return coerce_numbers(data, member)
            return data
        if isinstance(base, type) and issubclass(base, msgspec.Struct):
            hints = typing.get_type_hints(base, include_extras=True)
            return {k: coerce_numbers(v, hints[k]) if k in hints else v for k, v in data.items()}
    return data


def _struct_info(tp: Any) -> Any:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp.__struct_config__
    return None


def gib(n: float) -> str:
    """``n`` bytes in words: GiB, or MiB below a hundredth of one."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else f"{n / 1024**2:.1f} MiB"
