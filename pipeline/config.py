"""One configuration system for every command.

Typed dataclasses are the single source of truth. A YAML file sets fields, dotted command-line
overrides (``--train.lr=3e-5`` or ``--train.lr 3e-5``) apply last. Unknown keys and values of the
wrong type are errors that name the key, never silently ignored.

Every field carries its help text in ``metadata["help"]``; use :func:`option` to declare one::

    @dataclass
    class TrainConfig:
        lr: float = option(3e-5, "Peak learning rate after warmup.")

Validation lives in each dataclass's ``__post_init__`` and raises :class:`ConfigError` with a message
that says what to change.

A section that earlier versions wrote and this one no longer holds is a :class:`Legacy` in the class's
``LEGACY`` (the one compatibility spot): read when a config is made from a mapping (a file, overrides, a
saved config), folded into the current fields, and never a field itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pipeline.errors import ConfigError

T = TypeVar("T")


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None) -> Any:
    """A dataclass field with a help string (shown by ``--help`` and in docs)."""
    meta = {"help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


YAML_BOOL_WORDS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert the few safe cases (int→float, str→Path)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        if isinstance(value, bool) and value not in args:
            # YAML 1.1 reads a bare no/off/yes/on as a boolean: `mixed_precision: no` arrives as False
            spelled = [a for a in YAML_BOOL_WORDS[value] if a in args]
            value = spelled[0] if spelled else value
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}: {value!r} is not one of {choices}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str) and origin is list:
            value = [value]  # a single path on the command line is a one-element list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {_type_name(tp)} fields, got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"{key}: expected a path, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")


@dataclasses.dataclass(frozen=True)
class Legacy:
    """A section of earlier versions that a config class reads but does not hold (its ``LEGACY``):
    ``schema``, a dataclass, checks the section's keys and types (in a file, a saved config or
    ``--section.key=value`` overrides); ``read(data, section)`` returns the mapping without it, the
    section folded into the current keys. Not a field: :func:`to_dict` and ``--help`` never see it."""

    schema: type
    read: Callable[[dict[str, Any], Any], dict[str, Any]]


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _key_types(cls: type) -> dict[str, Any]:
    """What a mapping for ``cls`` may hold: its fields, and the sections of earlier versions it reads."""
    legacy = getattr(cls, "LEGACY", {})
    return {**_field_types(cls), **{name: section.schema for name, section in legacy.items()}}


def _unknown_key(cls: type, key: str, prefix: str) -> ConfigError:
    names = list(_field_types(cls))
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else f" Known keys: {', '.join(names)}."
    return ConfigError(f"unknown config key '{prefix}{key}'.{hint}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a nested mapping, checking keys and types (a section of an earlier
    version, listed in ``cls.LEGACY``, read into the current keys first)."""
    for name, legacy in getattr(cls, "LEGACY", {}).items():
        if name in data:
            section = _coerce(data[name], legacy.schema, prefix + name)
            data = legacy.read({k: v for k, v in data.items() if k != name}, section)
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in types_:
            raise _unknown_key(cls, key, prefix)
        kwargs[key] = _coerce(value, types_[key], prefix + key)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def to_dict(cfg: Any) -> Any:
    """The resolved config as plain YAML/JSON-serialisable data (paths become strings)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def _set_dotted(data: dict[str, Any], cls: type, dotted: str, value: Any) -> None:
    """Put ``value`` at ``a.b.c`` in ``data``, checking each part names a field of ``cls``."""
    parts = dotted.split(".")
    node, node_cls, prefix = data, cls, ""
    for i, part in enumerate(parts):
        types_ = _key_types(node_cls)
        if part not in types_:
            raise _unknown_key(node_cls, part, prefix)
        if i == len(parts) - 1:
            node[part] = value
            return
        sub = types_[part]
        if not dataclasses.is_dataclass(sub):
            raise ConfigError(f"'{prefix}{part}' is not a section; cannot set '{dotted}'")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"'{prefix}{part}' must be a mapping")
        node_cls, prefix = sub, f"{prefix}{part}."


def field_type(cls: type, dotted: str) -> Any:
    """The annotation of field ``a.b.c`` of ``cls`` (raises ConfigError for an unknown key)."""
    tp: Any = cls
    prefix = ""
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"'{prefix.rstrip('.')}' is not a section; cannot set '{dotted}'")
        types_ = _key_types(tp)
        if part not in types_:
            raise _unknown_key(tp, part, prefix)
        tp, prefix = types_[part], f"{prefix}{part}."
    return tp


def parse_value(text: str, tp: Any) -> Any:
    """A command-line string as a value: YAML scalars/lists, but strings stay strings."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        if text.lower() in ("none", "null", "~"):
            return None
        tp = args[0]  # Optional[X]: parse as X
    if tp is str or tp is Path:
        return text
    if tp in (int, float):
        try:
            return tp(text)  # YAML 1.1 reads "2e-5" as a string; Python does not
        except ValueError:
            return text  # let the type check name the key
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _deep_update(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def load_config(
    cls: type[T],
    yaml_path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> T:
    """Resolve a config: dataclass defaults < ``base`` < YAML file < dotted ``overrides``."""
    data: dict[str, Any] = {}
    if base:
        _deep_update(data, base)
    if yaml_path is not None:
        _deep_update(data, read_yaml(yaml_path))
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, cls, dotted, value)
    return from_dict(cls, data)


def help_lines(cls: type, prefix: str = "") -> list[str]:
    """``--key (type, default): help`` lines for every field, sections flattened with dots."""
    lines = []
    types_ = _field_types(cls)
    own = set(cls.__dict__.get("__annotations__", {}))
    # A class's own fields first, then those it inherits (e.g. a stage's execution options).
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        tp = types_[f.name]
        if dataclasses.is_dataclass(tp):
            lines.extend(help_lines(tp, f"{prefix}{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "required"
        lines.append(f"  --{prefix}{f.name} ({_type_name(tp)}, default {to_dict(default)!r})")
        if f.metadata.get("help"):
            lines.append(f"      {f.metadata['help']}")
    return lines
