"""What a reload changed, field by field, in lines an operator can read.

    tenants.beta.max_queue: 1 -> 0
    tenants: added gamma
    keys: removed 3f9a1c2b7d4e
    keys.9b2e4d6f8a0c.scopes: [inference] -> [inference, admin]
    llama.extra_args: [] -> [--cache-reuse, 256]

Tenants are matched by name and keys by id, so a reordered list is no change and a changed item is
named. A key's digest is never written: a changed digest reads ``keys.<id>.digest: changed``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from supervisor.config.schema import KeyConfig, TenantConfig

_HIDDEN = {(KeyConfig, "digest")}


def diff(old: object, new: object, prefix: str = "") -> list[str]:
    """``path: before -> after`` for every field that differs between two config dataclasses."""
    out: list[str] = []
    for f in dataclasses.fields(old):  # type: ignore[arg-type]
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        path = f"{prefix}{f.name}"
        if (type(old), f.name) in _HIDDEN:
            out.append(f"{path}: changed")
        elif _is_config(a) and _is_config(b):
            out.extend(diff(a, b, f"{path}."))
        elif _items_of(a, b, TenantConfig):
            out.extend(_keyed(a, b, path, "name"))
        elif _items_of(a, b, KeyConfig):
            out.extend(_keyed(a, b, path, "id"))
        else:
            out.append(f"{path}: {_show(a)} -> {_show(b)}")
    return out


def _is_config(value: object) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _items_of(a: object, b: object, cls: type) -> bool:
    return isinstance(a, tuple) and isinstance(b, tuple) and all(isinstance(v, cls) for v in (*a, *b))


def _keyed(old: tuple[Any, ...], new: tuple[Any, ...], path: str, key: str) -> list[str]:
    before = {getattr(item, key): item for item in old}
    after = {getattr(item, key): item for item in new}
    out = [f"{path}: removed {name}" for name in before if name not in after]
    out += [f"{path}: added {name}" for name in after if name not in before]
    for name in after:
        if name in before and before[name] != after[name]:
            out.extend(diff(before[name], after[name], f"{path}.{name}."))
    if not out and [getattr(i, key) for i in old] != [getattr(i, key) for i in new]:
        out.append(f"{path}: reordered")
    return out


def _show(value: object) -> str:
    """YAML-like: null, true, [a, b], {host: x, port: 1}; never a Python repr of an object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if _is_config(value):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))  # type: ignore[arg-type]
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in items) + "}"
    if isinstance(value, Path):
        return str(value)
    return str(value)
