"""A model's spec as plain JSON and back: the version a model's stable replicas run, kept apart
from the catalog.

Git is the desired state, but during a canary, and after one was rolled back, the stable replicas
go on running the last good version of the model, which is no longer the catalog's. The
controller stores that version with :func:`model_to_json` and reads it back after a restart with
:func:`model_from_json`; ``model_from_json(model_to_json(m)) == m`` for every model, through JSON
text too (tuples come back as tuples, nested policies as their frozen dataclasses).

One mechanism for every field: the conversion walks the dataclasses' own type hints, so a field
added to :class:`~llmgw.catalog.model.Model` (or to a type it holds) is stored and read back
without a change here, and a stored spec from before it existed reads with the field's default.
A key this version does not know is refused rather than dropped: a spec read back must run what
was stored, not a part of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal, Union

from llmgw.catalog.model import Model


def model_to_json(model: Model) -> dict[str, Any]:
    """Every field of ``model`` as JSON types (tuples become lists); for :func:`model_from_json`."""
    out = _to_json(model)
    assert isinstance(out, dict)
    return out


def model_from_json(d: Any) -> Model:
    """The :class:`Model` ``d`` describes (as :func:`model_to_json` wrote it).

    ValueError naming the field when ``d`` is malformed: not an object, a required field missing,
    an unknown key, a value of the wrong type or outside its choices, a number that is not finite.
    Missing optional fields take their defaults.
    """
    if not isinstance(d, dict):
        raise ValueError(f"a model spec must be an object, got {type(d).__name__}")
    out = _from_json(Model, d, "")
    assert isinstance(out, Model)
    return out


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, tuple | list):
        return [_to_json(v) for v in value]
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # The model module uses postponed annotations: resolve them once per class.
    return typing.get_type_hints(cls)


def _where(path: str) -> str:
    return f"model spec: {path}" if path else "model spec"


def _kind(value: Any) -> str:
    return type(value).__name__


def _from_json(tp: Any, value: Any, path: str) -> Any:
    """``value`` read as type ``tp`` (a dataclass, Literal, NewType, Optional, tuple or scalar)."""
    supertype = getattr(tp, "__supertype__", None)
    if supertype is not None:  # a NewType (ModelName): its base type
        return _from_json(supertype, value, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass(tp, value, path)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args or not isinstance(value, str):
            raise ValueError(f"{_where(path)} must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            try:
                return _from_json(rest[0], value, path)
            except ValueError:
                if type(None) not in args:
                    raise
                raise ValueError(f"{_where(path)} must be {_name(rest[0])} or null, got {_kind(value)}") from None
        raise TypeError(f"{path}: unions of several types are not supported")  # a model.py change; never input
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{_where(path)} must be a list, got {_kind(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{_where(path)} must be a list of {len(args)} items, got {len(value)}")
        return tuple(_from_json(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    return _scalar(tp, value, path)


def _name(tp: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number"}.get(tp, getattr(tp, "__name__", str(tp)))


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{_where(path)} must be a string, got {_kind(value)}")
        return value
    if tp is int:
        if type(value) is not int:  # bool is an int to Python, never to a spec
            raise ValueError(f"{_where(path)} must be an integer, got {_kind(value)}")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise ValueError(f"{_where(path)} must be a number, got {_kind(value)}")
        if not math.isfinite(value):
            raise ValueError(f"{_where(path)} must be a finite number, got {value!r}")
        return float(value)
    raise TypeError(f"{path}: no JSON form for {tp!r}")  # a model.py change; never input


def _dataclass(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"{_where(path)} must be an object, got {_kind(value)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in value if k not in fields)
    if unknown:
        raise ValueError(f'{_where(path)}: unknown key "{unknown[0]}" (a spec stored by a newer llmgw?)')
    hints = _hints(cls)
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _from_json(hints[name], value[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{_where(path)}: missing {name}")
    return cls(**kwargs)
