"""One validation layer for what a user hands parashift: numbers and files.

Numbers: :func:`number` (finite, in range, integral when asked) and argparse types built on it
(:func:`arg_int`, :func:`arg_float`). Files: :func:`read_text` and :func:`read_json` (size
limit, UTF-8, nesting depth, never echo the file's contents) and :func:`check` (a small schema:
each key's type and range, naming the offending key as ``file: key.sub[2]``).
Pure Python: no torch, no pandas.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import InputError

__all__ = ["number", "arg_int", "arg_float", "arg_choices_list", "read_text", "read_json", "check", "Num",
           "MAX_FILE_BYTES", "MAX_DEPTH", "file_size",
           "MAX_GLOBAL_BATCH", "MAX_SEQ_LEN", "MAX_STEP_SLOTS", "check_step_size"]

#: the largest file a user may hand parashift (traces, plans, cost models, configs)
MAX_FILE_BYTES = 64 * 2**20
#: the deepest nesting a JSON file may have
MAX_DEPTH = 64
#: the largest global batch (sequences per step) and sequence length a command accepts
MAX_GLOBAL_BATCH = 2**20
MAX_SEQ_LEN = 2**22
#: the most micro-batches x pipeline stages one compiled step may hold (its instruction count grows with it)
MAX_STEP_SLOTS = 2**20


def number(name: str, value: Any, *, lo: float | None = None, hi: float | None = None, integer: bool = False,
           lo_open: bool = False) -> float:
    """``value`` as a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), else InputError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value) if not integer else _to_int(value)
        except (TypeError, ValueError):
            kind = "an integer" if integer else "a number"
            raise InputError(f"{name} must be {kind}, got {_short(value)}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{name} must be a finite number, got {value}")
    if integer and value != int(value):
        raise InputError(f"{name} must be a whole number, got {value}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        op = ">" if lo_open else ">="
        raise InputError(f"{name} must be {op} {_num(lo)}, got {_num(value)}")
    if hi is not None and value > hi:
        raise InputError(f"{name} must be at most {_num(hi)}, got {_num(value)}")
    return int(value) if integer else float(value)


def _to_int(value: Any) -> int:
    if isinstance(value, str):
        return int(value.strip())
    f = float(value)
    if f != int(f):
        raise ValueError(value)
    return int(f)


def _num(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def arg_int(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, hi]``."""
    return _arg_type(int, "an integer", lo=lo, hi=hi, integer=True)


def arg_float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    return _arg_type(float, "a number", lo=lo, hi=hi, lo_open=lo_open)


def _arg_type(conv: Callable[[str], Any], kind: str, **bounds: Any) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = conv(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        try:
            return number("the value", v, **bounds)
        except InputError as e:
            raise argparse.ArgumentTypeError(str(e).replace("the value must", "must")) from None
    parse.__name__ = kind.split()[-1]
    return parse


def arg_choices_list(flag: str, text: str, conv: Callable[[str], Any], allowed: Any = None) -> tuple:
    """A comma-separated list of ``conv`` values, each in ``allowed`` when given; InputError otherwise."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise InputError(f"--{flag} {text!r} is empty; give a comma-separated list")
    out = []
    for x in items:
        try:
            v = conv(x)
        except ValueError:
            raise InputError(f"--{flag}: {x!r} is not valid; give a comma-separated list, e.g. "
                             f"{','.join(map(str, list(allowed)[:2])) if allowed else '0,1'}") from None
        if allowed is not None and v not in allowed:
            raise InputError(f"--{flag}: {x!r} is not one of {', '.join(map(str, allowed))}")
        out.append(v)
    return tuple(out)


def file_size(path: "str | Path", what: str) -> int:
    """The size of the regular file ``path`` in bytes; InputError when it is missing or not a file."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file; check the path") from None
    except OSError as e:
        raise InputError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if p.is_dir():
        raise InputError(f"{what} {path} is a folder; pass a file")
    return st.st_size


def read_text(path: "str | Path", what: str, *, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a user's file, refusing folders, files over ``limit`` bytes and binary data."""
    size = file_size(path, what)
    if size > limit:
        raise InputError(f"{what} {path} is {size / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB limit; "
                         f"pass a smaller file (e.g. a window of it)")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if b"\x00" in data:
        raise InputError(f"{what} {path} is a binary file (it holds NUL bytes); pass a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path} is not UTF-8 text (bad byte at offset {e.start}); pass a text file") from None


def read_json(path: "str | Path", what: str, *, limit: int = MAX_FILE_BYTES) -> Any:
    """The parsed JSON of a user's file (size, encoding and nesting checked; the text is never echoed)."""
    text = read_text(path, what, limit=limit)
    if _depth(text) > MAX_DEPTH:
        raise InputError(f"{what} {path} nests deeper than {MAX_DEPTH} levels; it is not a file parashift wrote")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise InputError(f"{what} {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                         f"write it again or fix the syntax") from None
    except ValueError as e:
        raise InputError(f"{what} {path}: {e}") from None
    except RecursionError:
        raise InputError(f"{what} {path} nests too deeply to read") from None
    return obj


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows; write a finite number")


def _depth(text: str) -> int:
    """The deepest bracket nesting of ``text`` outside strings (a cheap bound; no recursion)."""
    depth = worst = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > worst:
                worst = depth
                if worst > MAX_DEPTH:
                    return worst
        elif ch in "]}":
            depth -= 1
    return worst


class Num:
    """A schema leaf: a number in a range (``integer``, ``lo``, ``hi``, ``lo_open``)."""

    def __init__(self, lo: float | None = None, hi: float | None = None, *, integer: bool = False,
                 lo_open: bool = False) -> None:
        self.lo, self.hi, self.integer, self.lo_open = lo, hi, integer, lo_open


def check(obj: Any, schema: Any, where: str) -> Any:
    """Check ``obj`` against ``schema``; raise InputError naming the offending key (``where.key[i]``).

    A schema is: a type (``str``, ``bool``, ``dict``, ``list``); a :class:`Num`; a tuple of
    alternatives; ``{"key": schema}`` for an object whose listed keys are checked when present
    (``"key!"`` marks a required key; ``"*"`` checks every other value); ``[schema]`` for a list
    of items.
    """
    _check(obj, schema, where)
    return obj


def _kind(schema: Any) -> str:
    if isinstance(schema, Num):
        return "an integer" if schema.integer else "a number"
    if isinstance(schema, Mapping):
        return "an object"
    if isinstance(schema, list):
        return "a list"
    if isinstance(schema, tuple):
        return " or ".join(_kind(s) for s in schema)
    return {str: "a string", bool: "true or false", dict: "an object", list: "a list",
            type(None): "null"}.get(schema, getattr(schema, "__name__", str(schema)))


def _check(obj: Any, schema: Any, where: str) -> None:
    if isinstance(schema, tuple):
        errors = []
        for s in schema:
            try:
                _check(obj, s, where)
                return
            except InputError as e:
                errors.append(e)
        raise InputError(f"{where} must be {_kind(schema)}, got {_type_name(obj)}")
    if isinstance(schema, Num):
        if isinstance(obj, bool) or not isinstance(obj, (int, float)):
            raise InputError(f"{where} must be {_kind(schema)}, got {_type_name(obj)}")
        number(where, obj, lo=schema.lo, hi=schema.hi, integer=schema.integer, lo_open=schema.lo_open)
        return
    if isinstance(schema, Mapping):
        if not isinstance(obj, Mapping):
            raise InputError(f"{where} must be an object, got {_type_name(obj)}")
        rest = schema.get("*")
        named = {k.rstrip("!") for k in schema if k != "*"}
        for k, s in schema.items():
            if k == "*":
                continue
            key = k.rstrip("!")
            if key not in obj:
                if k.endswith("!"):
                    raise InputError(f"{where} lacks the required key {key!r}")
                continue
            _check(obj[key], s, f"{where}.{key}")
        if rest is not None:
            for k, v in obj.items():
                if k not in named:
                    _check(v, rest, f"{where}.{k}")
        return
    if isinstance(schema, list):
        if not isinstance(obj, list):
            raise InputError(f"{where} must be a list, got {_type_name(obj)}")
        for i, v in enumerate(obj):
            _check(v, schema[0], f"{where}[{i}]")
        return
    if schema is dict or schema is list or schema is str or schema is type(None):
        if not isinstance(obj, schema):
            raise InputError(f"{where} must be {_kind(schema)}, got {_type_name(obj)}")
        return
    if schema is bool:
        if not isinstance(obj, bool):
            raise InputError(f"{where} must be true or false, got {_type_name(obj)}")
        return
    raise TypeError(f"unknown schema {schema!r}")


def _type_name(obj: Any) -> str:
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "a boolean"
    if isinstance(obj, (int, float)):
        return f"the number {obj:g}" if isinstance(obj, float) else f"the number {obj}"
    if isinstance(obj, str):
        return "a string"
    if isinstance(obj, list):
        return "a list"
    if isinstance(obj, Mapping):
        return "an object"
    return type(obj).__name__



def check_step_size(global_batch: int, dp: int = 1, mbs: int = 1, pp: int = 1) -> None:
    """Refuse a step whose micro-batches x stages exceed :data:`MAX_STEP_SLOTS` before compiling it."""
    slots = (global_batch // max(1, dp * mbs)) * max(1, pp)
    if slots > MAX_STEP_SLOTS:
        from .errors import LimitError
        raise LimitError(f"a step of {global_batch} sequences with dp={dp}, mbs={mbs}, pp={pp} has {slots:,} "
                         f"micro-batch slots, over the limit of {MAX_STEP_SLOTS:,}; lower --global-batch or raise "
                         f"dp or mbs")
