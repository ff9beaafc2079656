"""Which integer inputs index a table, and which of their values reach its rows: verify
then draws them over the whole table. Drawn from a few small values only, ids never reach
the rows where a clamped, truncated or wrongly offset table differs, and a wrong graph passes.

The module is run once at the example sizes with every integer input zero (a valid id for
any table, before an offset), and each lookup (an embedding, a tensor indexed by ids,
``index_select``, ``gather``) reports the input whose values it reads: the input itself, a
view of it, or the input cast or shifted by a constant (``ids + 2``, whose zeros arrive as
2: the ids that land on a row are then ``0..rows-3``). It is run again at other sizes, and
a lookup counts only where both runs made it alike: a table made in forward from the
sequence, or a shift by a length, differs. An input that indexes several tables gets the
values that land on a row of each."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attn_export._deps import require
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.shapes import example_sizes

__all__ = ["lookup_ranges", "undeclared_ids", "with_lookup_ranges"]

#: Ops whose output holds the same values as their integer input, or shifted by a constant.
_CARRY = frozenset({"_to_copy", "clone", "repeat", "_unsafe_view", "expand_copy", "add", "sub"})


def undeclared_ids(spec: ModelSpec) -> list[str]:
    """The integer inputs drawn from a range the spec does not declare (not masks)."""
    return [t.name for t in spec.inputs if t.is_ids and t.values is None]


def _lookups(func: Any, args: Sequence[Any]) -> list[tuple[Any, Any, int]]:
    """``(table, index, axis)`` for each table ``func`` reads rows of by an index tensor."""
    name = func.overloadpacket.__name__
    if name == "embedding":
        return [(args[0], args[1], 0)]
    if name in ("index_select", "gather"):
        return [(args[0], args[2], int(args[1]))]
    if name == "index":
        return [(args[0], index, axis) for axis, index in enumerate(args[1]) if index is not None]
    return []


def with_lookup_ranges(module: Any, spec: ModelSpec) -> ModelSpec:
    """``spec`` with its ids' ranges read from ``module`` (``lookup_ranges``), as build,
    the Python API and ``verify --spec`` learn them before drawing any."""
    return dataclasses.replace(spec, vocab=lookup_ranges(module, spec))


def lookup_ranges(module: Any, spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """The least and greatest value of each undeclared integer input of ``spec`` that lands
    on a row of every table it indexes in ``module`` (the adapter ``factory.instantiate``
    returns), from the lookups that stay the same at two sizes: a table sliced to the
    sequence, or a shift by a length, gives other rows at other sizes and is left out.
    None where the module fails on zeros, which the build then reports from its own first run."""
    ids = undeclared_ids(spec)
    if not ids:
        return {}
    first = example_sizes(spec)
    free = spec.free_dims
    second = spec.with_sums({k: first[k] + 1 if first[k] < r.max else first[k] - 1 for k, r in free.items()})
    try:
        at_first, at_second = (_lookups_at(module, spec, ids, sizes) for sizes in (first, second))
    except (Exception, SystemExit):  # noqa: BLE001 - the build's first real run reports the module's failure
        return {}
    ranges: dict[str, tuple[int, int]] = {}
    for name, offset, rows in (lookup for lookup in at_first if lookup in at_second):
        low, high = ranges.get(name, (0, rows - 1 - offset))
        ranges[name] = (max(low, -offset), min(high, rows - 1 - offset))
    return {k: v for k, v in ranges.items() if v[0] <= v[1]}


def _lookups_at(module: Any, spec: ModelSpec, ids: list[str], sizes: Mapping[str, int]) -> list[tuple[str, int, int]]:
    """``(input, offset, rows)`` of each lookup the module makes at ``sizes`` with its ``ids``
    zero: the value the zeros arrive at (``ids + 2``: 2), and the table's rows there."""
    torch = require("torch", "reading the module's lookups")
    from torch.utils._python_dispatch import TorchDispatchMode

    feeds = make_feeds(spec, sizes, 0)
    args = {k: torch.from_numpy(np.zeros_like(v) if k in ids else np.ascontiguousarray(v)) for k, v in feeds.items()}
    carried: dict[int, str] = {args[name].untyped_storage().data_ptr(): name for name in ids if args[name].numel()}
    kept: list[Any] = []  # the carried tensors stay alive, so no storage address is reused
    lookups: list[tuple[str, int, int]] = []

    def source(value: Any) -> str | None:
        is_tensor = isinstance(value, torch.Tensor) and not value.is_floating_point() and value.numel()
        return carried.get(value.untyped_storage().data_ptr()) if is_tensor else None

    class Lookups(TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, a: Sequence[Any] = (), kw: Any = None) -> Any:
            out = func(*a, **(kw or {}))
            name = source(a[0]) if a else None
            # the id first, the rest one number each (ids + 2, not 39 - ids, ids + ids or ids * 2)
            others = [v for v in a[1:] if isinstance(v, torch.Tensor)]
            shift = all(source(v) is None and v.numel() == 1 for v in others) and (kw or {}).get("alpha", 1) == 1
            if name and shift and func.overloadpacket.__name__ in _CARRY and isinstance(out, torch.Tensor):
                carried[out.untyped_storage().data_ptr()] = name
                kept.append(out)
            for table, index, axis in _lookups(func, a):
                read = source(index)
                if read is not None and int(index.min()) == int(index.max()):
                    lookups.append((read, int(index.min()), int(table.shape[axis])))
            return out

    with torch.no_grad(), Lookups():
        module(*(args[t.name] for t in spec.inputs))
    return lookups
