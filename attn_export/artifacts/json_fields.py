"""A JSON document from elsewhere (a shard's verify report) read field by field, each checked
against the type it must be before it is used: ``dict()`` and ``list()`` turned a list of
pairs into an object and a string into a list of its letters without a word, and a number
given as a string failed later, in merging or rendering, as an internal error."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from attn_export.errors import ArtifactError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["json_field", "json_object", "json_record", "mistyped", "refuse_unknown"]

#: What a JSON value is called in a message.
_JSON_KINDS = {
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "a list",
    dict: "an object",
    type(None): "null",
}

_ABSENT: Any = object()

_Record = TypeVar("_Record", bound="DataclassInstance")


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def mistyped(value: Any, hint: Any, where: str) -> str | None:
    """Where in ``value`` a field is not of the type ``hint`` says (``cases[0].seed: a
    string, not int``), or None; a dataclass instance is checked field by field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if value is None and len(arms) < len(args):
            return None
        if len(arms) == 1:
            return mistyped(value, arms[0], where)
        return None if any(mistyped(value, a, where) is None for a in arms) else f"{where}: not {_type_name(hint)}"
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, hint):
        hints = typing.get_type_hints(hint)
        fields = dataclasses.fields(hint)
        found = (mistyped(getattr(value, f.name), hints[f.name], f"{where}.{f.name}".lstrip(".")) for f in fields)
        return next((w for w in found if w), None)
    kind = origin or hint
    numbers = {float: (int, float), int: (int,)}.get(kind)
    if numbers is not None:
        fits = isinstance(value, numbers) and not isinstance(value, bool)
    elif isinstance(kind, type) and issubclass(kind, Mapping):
        fits = isinstance(value, Mapping)
        if fits and args:
            found = (
                mistyped(k, args[0], f"{where} key") or mistyped(v, args[1], f"{where}[{k!r}]")
                for k, v in value.items()
            )
            return next((w for w in found if w), None)
    elif isinstance(kind, type) and issubclass(kind, Sequence) and kind is not str:
        fits = isinstance(value, list | tuple)
        if fits and args:
            found = (mistyped(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
            return next((w for w in found if w), None)
    else:
        fits = not isinstance(kind, type) or isinstance(value, kind)
    return None if fits else f"{where}: {_kind(value)}, not {_type_name(hint)}"


def json_object(value: Any, where: str) -> Mapping[str, Any]:
    """``value`` if it is a JSON object; ArtifactError naming ``where`` otherwise."""
    if not isinstance(value, Mapping):
        raise ArtifactError(f"{where}: {_kind(value)}, not an object")
    return value


def json_field(doc: Mapping[str, Any], key: str, hint: Any, where: str = "", default: Any = _ABSENT) -> Any:
    """``doc[key]`` if it is of type ``hint`` (``default`` where the key is absent, if one is
    given); ArtifactError naming the field (``where.key``) and what it holds otherwise."""
    at = f"{where}.{key}" if where else key
    if key not in doc:
        if default is _ABSENT:
            raise ArtifactError(f"{at}: missing")
        return default
    problem = mistyped(doc[key], hint, at)
    if problem is not None:
        raise ArtifactError(problem)
    return doc[key]


def json_record(cls: type[_Record], value: Any, where: str, derived: Collection[str] = ()) -> _Record:
    """The dataclass ``cls`` from the JSON object ``value``, field by field: each field of
    the type its annotation gives (its default where the key is absent), the keys in
    ``derived`` (what ``to_dict`` adds: ``passed``) skipped; ArtifactError naming the first
    field (``where.key``) missing, mistyped or unknown. For records of plain fields (numbers,
    strings, lists and objects of them): one that holds another record reads it by hand."""
    doc = json_object(value, where)
    fields = dataclasses.fields(cls)
    refuse_unknown(doc, {*(f.name for f in fields), *derived}, where)
    hints = typing.get_type_hints(cls)
    read = {f.name: json_field(doc, f.name, hints[f.name], where, _default(f)) for f in fields}
    return cls(**read)


def refuse_unknown(doc: Mapping[str, Any], known: Collection[str], where: str) -> None:
    """ArtifactError naming the first key of ``doc`` not in ``known`` (``where.key``): a
    record read by hand passes the keys its ``to_dict`` writes, as ``json_record`` its
    fields, so every record of a report refuses a key it would not write."""
    unknown = next((k for k in doc if k not in known), None)
    if unknown is not None:
        raise ArtifactError(f"{where}.{unknown}: unknown field" if where else f"{unknown}: unknown field")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return _ABSENT if f.default_factory is dataclasses.MISSING else f.default_factory()
