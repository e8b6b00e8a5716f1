"""Reading the files a user gives kvlab (experiment and layout YAML, presets, profiles, tokenizers, notebooks).

Invariants, for every such file:

* it is a regular file, checked with ``stat`` before it is opened (:func:`regular_file`), so a FIFO, a device
  or a folder is refused at once instead of blocking or failing later;
* YAML mappings never hold a key twice (:func:`load_yaml`: PyYAML keeps the last one silently; kvlab refuses
  with the line of the second);
* no number read is NaN or infinite (:func:`check_finite`), and a boolean is never a number.

Every refusal is a :class:`~kvlab.errors.ConfigError` whose one line names the file (and line or field).
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError

#: the largest input text file kvlab reads whole (experiment, layout config, preset), in bytes
MAX_TEXT_BYTES = 64 << 20


def not_regular(mode: int) -> str | None:
    """What a file of ``mode`` (``st_mode``) is when it is not a regular file (a FIFO would block its reader, a
    device never ends), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file")


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` if it is a regular file (symbolic links followed); ConfigError naming it otherwise."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{path}: is a folder, not a {what}")
    kind = not_regular(mode)
    if kind is not None:
        raise ConfigError(f"{path}: is {kind}, not a regular {what} (kvlab reads {what}s from regular files only)")
    return path


def read_text(path: str | os.PathLike, what: str = "file", *, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of regular file ``path`` (at most ``max_bytes``); ConfigError naming it otherwise."""
    path = regular_file(path, what)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ConfigError(f"{path}: {size:,} bytes is larger than a {what} may be ({max_bytes:,} bytes)")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _strict_loader() -> type:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses a mapping key given twice."""

    def construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
        loader.flatten_mapping(node)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # SafeLoader reports unhashable keys itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first at line {seen[key] + 1}); kvlab never keeps "
                    "one silently", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


def parse_yaml(text: str, source: str) -> Any:
    """The data of YAML ``text`` (from ``source``, named in errors): duplicate keys refused, NaN/inf refused."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a kvlab dependency
        raise ConfigError("reading YAML files needs pyyaml (pip install pyyaml)") from None
    try:
        data = yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        if isinstance(exc, yaml.constructor.ConstructorError) and mark is not None and "twice" in str(exc.problem):
            raise ConfigError(f"{source}: line {mark.line + 1}: {exc.problem}") from None
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: not valid YAML{where} ({getattr(exc, 'problem', None) or exc})") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None
    check_finite(data, source)
    return data


def load_yaml(path: str | os.PathLike, what: str = "file") -> Any:
    """:func:`parse_yaml` of regular file ``path``."""
    return parse_yaml(read_text(path, what), str(path))


def load_json_object(path: str | os.PathLike, what: str) -> dict:
    """The JSON object in regular file ``path`` (a ``what``, named in errors), with no NaN or infinite number
    (json reads ``NaN`` / ``Infinity``); ConfigError naming the file otherwise."""
    import json

    text = read_text(path, what)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r}: must be a JSON object, got {type(data).__name__}")
    return check_finite(data, f"{what} {str(path)!r}")


def check_finite(data: Any, source: str, where: str = "") -> Any:
    """``data`` unchanged; ConfigError naming ``source`` and the field path of the first NaN or infinite float
    in it (nested mappings and lists)."""
    stack: list[tuple[str, Any]] = [(where, data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: {path or 'value'} is {value!r}; must be a finite number")
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return data


__all__ = ["MAX_TEXT_BYTES", "check_finite", "load_json_object", "load_yaml", "not_regular", "parse_yaml", "read_text",
           "regular_file"]
