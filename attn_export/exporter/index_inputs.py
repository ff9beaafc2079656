"""Which integer inputs index a table, and which of their values reach its rows: verify
then draws them over the whole table. Drawn from a few small values only, ids never reach
the rows where a clamped, truncated or wrongly offset table differs, and a wrong graph passes.

The module is run once at the example sizes with every integer input zero (a valid id for
any table, before an offset), and each lookup (an embedding, a tensor indexed by ids,
``index_select``, ``gather``) reports the input whose values it reads: the input itself, a
view of it, or the input cast or shifted by a constant (``ids + 2``, whose zeros arrive as
2: the ids that land on a row are then ``0..rows-3``). Every table counts at the size it
has there, also one made in forward; an input that indexes several gets the values that
land on a row of each."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from attn_export._deps import require
from attn_export.spec import ModelSpec
from attn_export.spec.inputs import make_feeds
from attn_export.spec.shapes import example_sizes

__all__ = ["lookup_ranges", "spec_with_vocab"]

#: Ops whose output holds the same values as their integer input, or shifted by a constant.
_CARRY = frozenset({"_to_copy", "clone", "repeat", "_unsafe_view", "expand_copy", "add", "sub"})


def _ids(spec: ModelSpec) -> list[str]:
    """The integer inputs drawn from a range the spec does not declare (not masks)."""
    return [t.name for t in spec.inputs if t.is_ids and t.values is None]


def spec_with_vocab(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the values its ids may take, read from its module (built only where
    an id input needs it): a graph no build made has no manifest that learnt them."""
    if not _ids(spec):
        return spec
    from attn_export.exporter.factory import instantiate

    return dataclasses.replace(spec, vocab=lookup_ranges(instantiate(spec), spec))


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


def lookup_ranges(module: Any, spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """The least and greatest value of each undeclared integer input of ``spec`` that lands
    on a row of every table it indexes in ``module`` (the adapter ``factory.instantiate``
    returns); none where the module fails on zeros, which the build then reports from its
    own first run."""
    torch = require("torch", "reading the module's lookups")
    from torch.utils._python_dispatch import TorchDispatchMode

    ids = _ids(spec)
    if not ids:
        return {}
    feeds = make_feeds(spec, example_sizes(spec), 0)
    args = {k: torch.from_numpy(np.zeros_like(v) if k in ids else np.ascontiguousarray(v)) for k, v in feeds.items()}
    carried: dict[int, str] = {args[name].untyped_storage().data_ptr(): name for name in ids if args[name].numel()}
    kept: list[Any] = []  # the carried tensors stay alive, so no storage address is reused
    ranges: dict[str, tuple[int, int]] = {}

    def source(value: Any) -> str | None:
        is_tensor = isinstance(value, torch.Tensor) and not value.is_floating_point() and value.numel()
        return carried.get(value.untyped_storage().data_ptr()) if is_tensor else None

    class Lookups(TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, a: Sequence[Any] = (), kw: Any = None) -> Any:
            out = func(*a, **(kw or {}))
            tensors = [v for v in a if isinstance(v, torch.Tensor)]
            read = [name for name in map(source, tensors) if name]
            others_constant = all(source(v) or v.numel() == 1 for v in tensors)  # ids + ids is no shift
            carries = func.overloadpacket.__name__ in _CARRY and isinstance(out, torch.Tensor)
            if carries and len(read) == 1 and others_constant:
                carried[out.untyped_storage().data_ptr()] = read[0]
                kept.append(out)
            for table, index, axis in _lookups(func, a):
                name = source(index)
                if name is None or int(index.min()) != int(index.max()):
                    continue
                offset, rows = int(index.min()), int(table.shape[axis])
                low, high = ranges.get(name, (0, rows - 1 - offset))
                ranges[name] = (max(low, -offset), min(high, rows - 1 - offset))
            return out

    try:
        with torch.no_grad(), Lookups():
            module(*(args[t.name] for t in spec.inputs))
    except (Exception, SystemExit):  # noqa: BLE001 - the build's first real run reports the module's failure
        return {}
    return {k: v for k, v in ranges.items() if v[0] <= v[1]}
