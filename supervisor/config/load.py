"""Load the YAML configuration into ``schema.Config``, reporting every bad field in one pass.

Order: YAML parse (syntax errors carry line and column; duplicate keys are errors) -> ``${ENV_VAR}``
substitution in every string -> conversion driven by the dataclasses' type hints (unknown keys,
wrong types and range checks, each reported by its path) -> cross-field rules. Nothing is half
applied: either a whole ``Config`` comes back or ``ConfigError`` lists all the problems.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from proxy.settings import DEFAULT_PRIORITY, parse_priority
from supervisor.config.rules import cross_check
from supervisor.config.schema import Config, ModelConfig, NameOrPath, Priority, ProxyConfig
from supervisor.errors import ConfigError
from supervisor.launch.chat_template import is_builtin

CONFIG_ENV = "LLAMAGATE_CONFIG"
_ENV_REF = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$\{[^}]*\}?")


class _EnvStr(str):
    """A string that came out of ``${VAR}`` substitution: it may stand for a number or a boolean
    (environment variables are always text)."""


class _Missing:
    """Stands for a value whose ``${VAR}`` was not set: already reported, so not converted."""


_MISSING = _Missing()
_LARGEST = 2**53  # beyond it a number is a typo, and floats lose integer precision


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: PyYAML would silently keep the last one."""


def _mapping_without_duplicates(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # "<<: *anchor": merged keys may be overridden; construct_mapping merges them
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # a list or a mapping as a key
            raise yaml.constructor.ConstructorError(
                None, None, "found unhashable key", key_node.start_mark
            ) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def resolve_config_path(explicit: str | Path | None, env: Mapping[str, str] | None = None) -> Path | None:
    """``--config`` wins, then ``$LLAMAGATE_CONFIG``; None means the embedded default."""
    if explicit:
        return Path(explicit)
    value = (os.environ if env is None else env).get(CONFIG_ENV)
    return Path(value) if value else None


def load_config(path: Path | None, env: Mapping[str, str] | None = None) -> Config:
    if path is None:
        return Config()
    return parse_config(_read(path), source=str(path), base_dir=path.resolve().parent, env=env)


def load_proxy_config(path: Path | None, env: Mapping[str, str] | None = None) -> ProxyConfig:
    """Only the ``proxy`` section, checked alone: for commands that need just the listener
    (``status``), run where the other sections' ``${VAR}``s (a model's digest...) are not set."""
    if path is None:
        return ProxyConfig()
    raw = _parse_yaml(_read(path), str(path))
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigError(["config: must be a mapping of keys to values"], str(path))
    section = _substitute({"proxy": raw.get("proxy", {})}, "", os.environ if env is None else env, problems)
    proxy = _Converter(path.resolve().parent, problems).value(ProxyConfig, section["proxy"], "proxy")
    if problems:
        raise ConfigError(problems, str(path))
    assert isinstance(proxy, ProxyConfig)
    return proxy


def load_sections(path: Path | None, names: tuple[str, ...], env: Mapping[str, str] | None = None) -> Config:
    """A ``Config`` with only the named top-level sections read from the file (the others keep their
    defaults), checked alone: for commands that need a few sections (``keys`` and ``usage`` need
    ``store`` and ``tenants``), run where the other sections' ``${VAR}``s (a model's digest...) are not
    set. No cross-field rule runs: they involve sections that were not read."""
    if path is None:
        return Config()
    raw = _parse_yaml(_read(path), str(path))
    if not isinstance(raw, dict):
        raise ConfigError(["config: must be a mapping of keys to values"], str(path))
    problems: list[str] = []
    chosen = {name: raw[name] for name in names if name in raw}
    chosen = _substitute(chosen, "", os.environ if env is None else env, problems)
    config = _Converter(path.resolve().parent, problems).value(Config, chosen, "")
    if problems:
        raise ConfigError(problems, str(path))
    assert isinstance(config, Config)
    return config


def served_names(path: Path | None) -> tuple[str, ...]:
    """The names of the models a configuration serves (``models[].name``, else ``llama.model.alias``),
    read from the file as written, without checking the rest of those sections: for the commands that
    must refuse a key for a model the daemon does not serve, and run where the sections' other
    ``${VAR}``s (a model's digest) are not set."""
    default = ModelConfig().alias
    if path is None:
        return (default,)
    raw = _parse_yaml(_read(path), str(path))
    if not isinstance(raw, dict):
        return (default,)
    models = raw.get("models")
    if isinstance(models, list) and models:
        return tuple(m["name"] for m in models if isinstance(m, dict) and isinstance(m.get("name"), str))
    llama = raw.get("llama")
    model = llama.get("model") if isinstance(llama, dict) else None
    alias = model.get("alias") if isinstance(model, dict) else None
    return (alias if isinstance(alias, str) else default,)


def _read(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror or exc}"], source=str(path)) from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        bad = data[exc.start : exc.start + 1].hex()
        where = f"line {line}, column {column}"
        raise ConfigError(
            [f"{where}: byte 0x{bad} is not UTF-8 (save the file as UTF-8)"], str(path)
        ) from None


def _parse_yaml(text: str, source: str) -> Any:
    try:
        raw = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError([f"{where}{exc.problem or exc.context or 'invalid YAML'}"], source) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([f"invalid YAML: {exc}"], source) from exc
    return {} if raw is None else raw


def parse_config(
    text: str, *, source: str = "config", base_dir: Path | None = None, env: Mapping[str, str] | None = None
) -> Config:
    raw = _parse_yaml(text, source)
    problems: list[str] = []
    raw = _substitute(raw, "", os.environ if env is None else env, problems)
    conv = _Converter(base_dir or Path.cwd(), problems)
    config = conv.value(Config, raw, "")
    # Cross-field rules run even when single fields failed (one pass reports everything), but a
    # field that already has a problem held a placeholder, so rules about it are not repeated.
    bad_paths = {p.split(": ", 1)[0] for p in problems}
    problems.extend(p for p in cross_check(config) if p.split(": ", 1)[0] not in bad_paths)
    if problems:
        raise ConfigError(problems, source)
    assert isinstance(config, Config)
    return config


def _null_problem(tp: Any, path: str) -> str:
    """What to write instead of an empty value: ``proxy:`` with nothing under it is YAML's null."""
    if dataclasses.is_dataclass(tp):
        if path.endswith("]"):
            return "is empty (null): give its keys, or remove the item"
        return "is empty (null): give its keys, or remove the line to keep the defaults"
    if typing.get_origin(tp) is tuple:
        return "is empty (null): write a list (e.g. [] for none), or remove the line to keep the default"
    return "must not be null"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _substitute(node: Any, path: str, env: Mapping[str, str], problems: list[str]) -> Any:
    if isinstance(node, dict):
        return {k: _substitute(v, _join(path, str(k)), env, problems) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, f"{path}[{i}]", env, problems) for i, v in enumerate(node)]
    if not isinstance(node, str) or "$" not in node:
        return node

    missing = False

    def one(m: re.Match[str]) -> str:
        nonlocal missing
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        if name is None:
            what = f"unsupported substitution {m.group(0)} (only ${{NAME}}; $$ for a literal $)"
            problems.append(f"{path or 'config'}: {what}")
            missing = True
            return ""
        if name not in env:
            problems.append(f"{path or 'config'}: environment variable {name} is not set")
            missing = True
            return ""
        return env[name]

    out = _EnvStr(_ENV_REF.sub(one, node))
    return _MISSING if missing else out


class _Converter:
    """Turns the raw YAML tree into the typed dataclasses, appending ``path: problem`` lines."""

    def __init__(self, base_dir: Path, problems: list[str]) -> None:
        self.base_dir = base_dir
        self.problems = problems

    def bad(self, path: str, message: str) -> None:
        self.problems.append(f"{path or 'config'}: {message}")

    def value(self, tp: Any, raw: Any, path: str) -> Any:
        if raw is _MISSING:
            return None
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            return None if raw is None else self.value(inner[0], raw, path)
        if raw is None:
            self.bad(path, _null_problem(tp, path))
            return None
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self.dataclass(tp, raw, path)
        if origin is Mapping or origin is dict:
            return self.mapping(tp, raw, path)
        if origin is tuple:
            if not isinstance(raw, list):
                self.bad(path, "must be a list")
                return ()
            item = typing.get_args(tp)[0]
            items = (self.value(item, v, f"{path}[{i}]") for i, v in enumerate(raw))
            # A null or unset item was reported; dropping it keeps the cross-field rules (which
            # read every item) away from a None where a value must be.
            return tuple(v for v in items if v is not None)
        if origin is Literal:
            choices = typing.get_args(tp)
            if raw not in choices:
                self.bad(path, f"must be one of {', '.join(map(str, choices))} (got {raw!r})")
                return choices[0]
            return str(raw)
        return self.scalar(tp, raw, path)

    def mapping(self, tp: Any, raw: Any, path: str) -> Any:
        """A mapping of names (strings) to values of one type, read-only."""
        if not isinstance(raw, dict):
            self.bad(path, "must be a mapping of names to values")
            return types.MappingProxyType({})
        item = typing.get_args(tp)[1]
        out: dict[str, Any] = {}
        for key, raw_item in raw.items():
            if not isinstance(key, str):
                self.bad(_join(path, str(key)), "must be named by a string")
                continue
            value = self.value(item, raw_item, _join(path, key))
            if value is not None:
                out[key] = value
        return types.MappingProxyType(out)

    def scalar(self, tp: Any, raw: Any, path: str) -> Any:
        if isinstance(raw, _EnvStr) and tp in (int, float, bool):
            with contextlib.suppress(yaml.YAMLError):
                raw = yaml.safe_load(raw)
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            self.bad(path, f"must be true or false (got {raw!r})")
            return False
        if tp is int:
            if isinstance(raw, int) and not isinstance(raw, bool):
                if abs(raw) > _LARGEST:
                    # Budget arithmetic mixes ints and floats: 1e400 tokens would overflow it.
                    self.bad(path, f"is too large (got {raw!r})")
                    return 0
                return raw
            self.bad(path, f"must be an integer (got {raw!r})")
            return 0
        if tp is float:
            if isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) > _LARGEST:
                self.bad(path, f"is too large (got {raw!r})")
                return 0.0
            if isinstance(raw, int | float) and not isinstance(raw, bool):
                if not math.isfinite(raw):
                    # .inf would pass every "> 0" check and overflow a timer later; .nan fails them
                    # with a confusing message.
                    self.bad(path, f"must be a finite number (got {raw!r})")
                    return 0.0
                return float(raw)
            self.bad(path, f"must be a number (got {raw!r})")
            return 0.0
        if tp is str:
            if isinstance(raw, str):
                return str(raw)
            self.bad(path, f"must be a string (got {raw!r})")
            return ""
        if tp is Priority:
            try:
                return Priority(parse_priority(raw))
            except ValueError as exc:
                self.bad(path, str(exc))
                return Priority(DEFAULT_PRIORITY)
        if tp is NameOrPath:
            if not isinstance(raw, str) or not raw:
                self.bad(path, f"must be a built-in name or a file path (got {raw!r})")
                return NameOrPath("")
            if is_builtin(raw):
                return NameOrPath(raw)
            return NameOrPath(str(self.scalar(Path, raw, path)))
        if tp is Path:
            if not isinstance(raw, str) or not raw:
                self.bad(path, f"must be a path (got {raw!r})")
                return Path()
            # Relative paths are relative to the config file, not to wherever the daemon was started.
            p = Path(raw).expanduser()
            return p if p.is_absolute() else self.base_dir / p
        raise TypeError(f"unsupported config type {tp!r} at {path}")

    def dataclass(self, cls: type[Any], raw: Any, path: str) -> Any:
        if not isinstance(raw, dict):
            self.bad(path, "must be a mapping of keys to values")
            return cls()
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls)}
        for key in raw:
            if not isinstance(key, str) or key not in known:
                close = difflib.get_close_matches(str(key), list(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                self.bad(_join(path, str(key)), f"unknown key{hint}")
        values: dict[str, Any] = {}
        for name, fld in known.items():
            if name not in raw:
                continue
            before = len(self.problems)
            value = self.value(hints[name], raw[name], _join(path, name))
            check = fld.metadata.get("check")
            if raw[name] is _MISSING:
                continue  # reported by the substitution; the default stands in
            if value is None and len(self.problems) > before:
                continue  # a null where a value must be: reported; the default stands in
            if len(self.problems) == before and check is not None and value is not None:
                message = check(value)
                if message:
                    self.bad(_join(path, name), message)
            values[name] = value
        try:
            return cls(**values)
        except (TypeError, ValueError):
            return cls()


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The inverse of loading: plain YAML-ready values (paths as strings, tuples as lists)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, Path):
            return str(value)
        return value

    out: dict[str, Any] = plain(cfg)
    return out
