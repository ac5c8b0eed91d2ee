"""Output paths of a sub-command, checked before the work and written all or nothing.

A command module lists its output options in ``OUTPUTS`` (``{dest: kind}``, kind ``"file"``,
``"image"`` or ``"dir"``). :class:`Outputs` checks each given path is writable before the command
runs (the folder exists and is writable, the path is not a folder, an image has an image suffix),
points the command at a temporary file beside each target, and on success renames every
temporary file onto its target (``os.replace``: atomic per file); on failure it removes them, so
a failed command leaves no new file behind and never a partly written one.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import OutputError

__all__ = ["Outputs", "check_output", "IMAGE_SUFFIXES"]

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def check_output(path: str, kind: str, flag: str) -> None:
    """Raise OutputError unless ``path`` can be written as a ``kind`` ("file", "image" or "dir")."""
    if not path or not str(path).strip():
        raise OutputError(f"{flag} is empty; give a file path")
    p = Path(path).expanduser()
    if kind == "dir":
        if p.exists() and not p.is_dir():
            raise OutputError(f"{flag} {path} is a file, not a folder; give a folder path")
        parent = p if p.is_dir() else _existing_parent(p)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(f"{flag} {path}: cannot create files in {parent} (permission denied); choose "
                              f"another folder")
        return
    if p.is_dir() or str(path).endswith(os.sep):
        raise OutputError(f"{flag} {path} is a folder; give a file path inside it, e.g. {p / _example(kind)}")
    if kind == "image" and p.suffix.lower() not in IMAGE_SUFFIXES:
        raise OutputError(f"{flag} {path} must end in an image suffix ({', '.join(IMAGE_SUFFIXES)}), e.g. "
                          f"{p.name or 'plot'}.png")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: cannot write in {parent} (permission denied); choose another folder")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputError(f"{flag} {path} exists and is read-only; remove it or choose another path")


def _example(kind: str) -> str:
    return "plot.png" if kind == "image" else "out.json"


def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


class Outputs:
    """The output options of one command run: checked, redirected to temporary files, committed."""

    def __init__(self, args: argparse.Namespace, spec: Mapping[str, str], flags: Mapping[str, str] | None = None):
        self.args = args
        self.final: dict[str, str] = {}
        self.temp: dict[str, str] = {}
        flags = flags or {}
        seen: dict[str, str] = {}
        for dest, kind in spec.items():
            path = getattr(args, dest, None)
            if path is None:
                continue
            flag = flags.get(dest, "--" + dest.replace("_", "-"))
            check_output(path, kind, flag)
            key = os.path.abspath(os.path.expanduser(path))
            if key in seen:
                raise OutputError(f"{seen[key]} and {flag} both write {path}; give them different paths")
            seen[key] = flag
            if kind == "dir":
                continue
            p = Path(path).expanduser()
            tmp = p.parent / f".{p.stem}.parashift-{os.getpid()}-{len(self.temp)}.tmp{p.suffix}"
            self.final[dest], self.temp[dest] = str(path), str(tmp)
            setattr(args, dest, str(tmp))

    def commit(self, result: Any) -> Any:
        """Move every written temporary file onto its target; return ``result`` with the real paths."""
        try:
            for dest, tmp in self.temp.items():
                if os.path.exists(tmp):
                    os.replace(tmp, os.path.expanduser(self.final[dest]))
        except OSError as e:
            self.abort()
            raise OutputError(f"cannot write {e.filename}: {e.strerror}") from None
        self._restore()
        return _swap(result, {t: self.final[d] for d, t in self.temp.items()})

    def abort(self) -> None:
        """Remove the temporary files (the targets are untouched)."""
        for tmp in self.temp.values():
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self._restore()

    def _restore(self) -> None:
        for dest, path in self.final.items():
            setattr(self.args, dest, path)


def _swap(obj: Any, names: Mapping[str, str]) -> Any:
    """``obj`` with every string equal to a temporary path replaced by its target."""
    if isinstance(obj, str):
        return names.get(obj, obj)
    if isinstance(obj, dict):
        return {k: _swap(v, names) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_swap(v, names) for v in obj]
    return obj
