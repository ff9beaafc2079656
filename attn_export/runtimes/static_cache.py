"""A graph whose key/value cache is a buffer updated in place (the ``static-cache`` variant),
driven through the spec's growing-cache interface.

Such a graph takes each past as a ``[batch, kv_heads, max_seq, head_dim]`` buffer and the
number of positions already filled (``past_length``, an int64 scalar; the folder ``build
--target genai`` writes derives it from the mask instead, and records no length); it writes the new
tokens' keys and values at ``past_length`` and returns the same buffers as its presents
(ONNX Runtime writes into the past's own memory when both are bound to one OrtValue). The
graph records this interface in its metadata (``attn_export.static_cache``) and the
manifest in ``variant_info``.

``StaticCache.feeds`` turns the spec's feeds (pasts of ``past_seq`` positions) into the
graph's: each past copied into the first positions of a buffer of ``capacity`` positions,
**every other position NaN**, so a graph that reads a slot not yet filled gives NaN and
fails the comparison; ``StaticCache.filled`` cuts the presents back to the ``past_seq +
seq`` positions filled, which verify compares with PyTorch's growing cache. A present that
does not come back as its buffer (``StaticCache.misfit``: another capacity, or other axes)
is a failure of the run: a cache updated in place stays at its capacity.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from attn_export.errors import ArtifactError, InputError
from attn_export.model_spec import DimRange, TensorSpec
from attn_export.model_spec.shapes import sizes_from_feeds

if TYPE_CHECKING:
    import onnx

__all__ = ["CAPACITY_DIM", "LENGTH", "METADATA_KEY", "StaticCache", "capacity_for", "graph_signature"]

#: The graph metadata key holding the interface (JSON of ``StaticCache``).
METADATA_KEY = "attn_export.static_cache"
#: The graph's input holding the number of positions filled before this step.
LENGTH = "past_length"
#: The buffers' axis 2 in the graph: their capacity, chosen by whoever allocates them.
CAPACITY_DIM = "max_seq"


@dataclass(frozen=True)
class StaticCache:
    """How to drive a graph updating its cache in place."""

    #: (past input, present output) pairs: each present is its past's buffer, written in place.
    pairs: tuple[tuple[str, str], ...]
    #: The input fed the filled length; None where the graph derives it from the mask
    #: (``exporter.variants.static_cache.length_from_mask``: onnxruntime-genai feeds none).
    length: str | None = LENGTH

    def to_dict(self) -> dict[str, object]:
        return {"pairs": [list(p) for p in self.pairs], "length": self.length}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> StaticCache | None:
        """The interface a graph records, or None for a graph with a growing cache."""
        text = metadata.get(METADATA_KEY)
        if text is None:
            return None
        try:
            raw = json.loads(text)
            length = raw["length"]
            if length is not None and not isinstance(length, str):
                raise TypeError(f"'length' is {length!r}, not an input's name or null")
            return cls(tuple((str(p), str(q)) for p, q in raw["pairs"]), length)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise ArtifactError(f"the graph's {METADATA_KEY} metadata is malformed: {e}") from e

    def feeds(self, feeds: Mapping[str, np.ndarray], capacity: int) -> dict[str, np.ndarray]:
        """The graph's feeds for the spec's ``feeds``: pasts in NaN-poisoned buffers."""
        out = dict(feeds)
        past = 0
        for name, _ in self.pairs:
            arr = feeds[name]
            past = arr.shape[2]
            buffer = np.full((*arr.shape[:2], capacity, *arr.shape[3:]), np.nan, arr.dtype)
            buffer[:, :, :past] = arr
            out[name] = buffer
        if self.length is not None:
            out[self.length] = np.array(past, np.int64)
        return out

    def in_place(self, proto: onnx.ModelProto) -> bool:
        """Whether every present is written straight into its past's buffer: it is an output
        of the GroupQueryAttention node that reads that past (ONNX Runtime then appends in
        the past's memory when both are bound to one buffer). A present that another node
        produces would be a copy into the bound buffer, not the same memory."""
        makers = {out: node for node in proto.graph.node for out in node.output}
        for past, present in self.pairs:
            node = makers.get(present)
            if node is None or (node.domain, node.op_type) != ("com.microsoft", "GroupQueryAttention"):
                return False
            if past not in node.input:
                return False
        return True

    def total_dim(self, outputs: Sequence[TensorSpec]) -> str:
        """The spec's name for the presents' length (``total_seq``)."""
        present = self.pairs[0][1]
        return str(next(t for t in outputs if t.name == present).shape[2])

    def filled(
        self,
        signature: tuple[Sequence[TensorSpec], Sequence[TensorSpec], Mapping[str, DimRange]],
        feeds: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """``outputs`` with each present cut to the positions filled after this step."""
        inputs, specs, dims = signature
        sizes = sizes_from_feeds(inputs, {k: v.shape for k, v in feeds.items()})
        name = self.total_dim(specs)
        if name in sizes:  # an input of that length (a mask) says it
            total = sizes[name]
        elif name in dims:
            total = sum(sizes[p] for p in dims[name].parts)
        else:
            raise InputError(f"no input and no declared dim says how long '{name}' is: the filled length is unknown")
        presents = {present for _, present in self.pairs}
        return {n: v[:, :, :total] if n in presents else v for n, v in outputs.items()}

    def misfit(self, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], capacity: int) -> str | None:
        """Why a present did not come back as its past's buffer for the spec's ``feeds``
        (``[batch, kv_heads, capacity, head_dim]``), or None."""
        for past, present in self.pairs:
            want = [*feeds[past].shape[:2], capacity, *feeds[past].shape[3:]]
            got = list(outputs[present].shape)
            if got != want:
                return (
                    f"present '{present}' came back {got}, not its buffer {want}: a cache updated in place "
                    f"stays at its capacity of {capacity} positions"
                )
        return None

    def signature(
        self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
    ) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The graph's inputs and outputs for the spec's: buffers of ``max_seq`` positions,
        and the length (where it is fed) after the spec's inputs."""
        buffers = {n for pair in self.pairs for n in pair}

        def buffer(t: TensorSpec) -> TensorSpec:
            shape = (*t.shape[:2], CAPACITY_DIM, *t.shape[3:])
            return dataclasses.replace(t, shape=shape) if t.name in buffers else t

        length = [] if self.length is None else [TensorSpec(self.length, "int64", ())]
        return [*map(buffer, inputs), *length], list(map(buffer, outputs))


def capacity_for(
    declared: int | None, dims: Mapping[str, DimRange], outputs: Sequence[TensorSpec], cache: StaticCache
) -> int:
    """The buffer's positions: the spec's ``[cache] max_seq``, else the fewest that hold every
    present the dims allow."""
    return declared or sum(dims[p].max for p in dims[cache.total_dim(outputs)].parts)


def graph_signature(
    proto: onnx.ModelProto, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> tuple[Sequence[TensorSpec], Sequence[TensorSpec]]:
    """The inputs and outputs ``proto`` should declare for a spec's: the spec's own, or for
    a graph updating its cache in place, its buffers and length (``StaticCache.signature``)."""
    static = StaticCache.from_metadata({p.key: p.value for p in proto.metadata_props})
    return (inputs, outputs) if static is None else static.signature(inputs, outputs)
