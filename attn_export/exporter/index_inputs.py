"""Which integer inputs are token ids, and how many rows their embedding has: verify then
draws ids over the whole table. Drawn from a few small values only, ids never reach the rows
where a clamped, truncated or wrongly offset table differs, and a wrong graph passes.

The module is run once with every integer input zero (a valid id for any table), and each
``nn.Embedding`` reports the input whose storage its indices share (the input itself, or a
view of it: ``input_ids.view(-1, seq)``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from attn_export._deps import require
from attn_export.spec import ModelSpec
from attn_export.spec.inputs import make_feeds
from attn_export.spec.shapes import example_sizes

__all__ = ["embedding_rows", "spec_with_vocab"]


def _ids(spec: ModelSpec) -> list[str]:
    """The integer inputs drawn from a range the spec does not declare (not masks)."""
    return [t.name for t in spec.inputs if t.is_ids and t.values is None]


def spec_with_vocab(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the rows its token ids index, read from its module (built only where
    an id input needs it): a graph no build made has no manifest that learnt them."""
    if not _ids(spec):
        return spec
    from attn_export.exporter.factory import instantiate

    return dataclasses.replace(spec, vocab=embedding_rows(instantiate(spec), spec))


def embedding_rows(module: Any, spec: ModelSpec) -> dict[str, int]:
    """The row count of the smallest embedding each undeclared integer input of ``spec``
    indexes in ``module`` (the adapter ``factory.instantiate`` returns); none where the
    module fails on zeros, which the build then reports from its own first run."""
    torch = require("torch", "reading the module's embeddings")
    ids = _ids(spec)
    tables = [m for m in module.modules() if isinstance(m, torch.nn.Embedding)]
    if not ids or not tables:
        return {}
    feeds = make_feeds(spec, example_sizes(spec), 0)
    args = {k: torch.from_numpy(np.zeros_like(v) if k in ids else np.ascontiguousarray(v)) for k, v in feeds.items()}
    storages = {args[name].untyped_storage().data_ptr(): name for name in ids if args[name].numel()}
    rows: dict[str, int] = {}

    def seen(table: Any, inputs: tuple[Any, ...]) -> None:
        index = inputs[0] if inputs else None
        name = storages.get(index.untyped_storage().data_ptr()) if isinstance(index, torch.Tensor) else None
        if name is not None:
            rows[name] = min(rows.get(name, table.num_embeddings), table.num_embeddings)

    hooks = [table.register_forward_pre_hook(seen) for table in tables]
    try:
        with torch.no_grad():
            module(*(args[t.name] for t in spec.inputs))
    except (Exception, SystemExit):  # noqa: BLE001 - the build's first real run reports the module's failure
        return {}
    finally:
        for hook in hooks:
            hook.remove()
    return rows
