"""Model specs as frozen dataclasses: what to build, how to feed it, how strictly to judge it.

Everything downstream (export, manifest, verify) reads these classes; ``parse`` makes them
from TOML.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attn_export.errors import SpecError
from attn_export.model_spec.masks import PATTERNS, MaskSpec
from attn_export.model_spec.tolerance import Tolerance
from attn_export.model_spec.variants import VariantInfo, variant_chain

__all__ = [
    "DTYPES",
    "EXPORTERS",
    "FULLY_MASKED",
    "MASK_KINDS",
    "MAX_DIM",
    "MODES",
    "DimRange",
    "Guard",
    "ModelSpec",
    "TensorSpec",
    "WeightsSpec",
    "concrete_shape",
]

DTYPES = ("float32", "float16", "float64", "int32", "int64", "bool")
MASK_KINDS = PATTERNS
#: What build and verify do where PyTorch and the graph disagree on a fully masked row:
#: "match" repairs the graph or fails; "ignore" compares only rows that attend to something.
FULLY_MASKED = ("match", "ignore")
EXPORTERS = ("dynamo", "torchscript")
MODES = ("eval", "train")
#: Refused before allocating: sizes above this would not fit any machine we verify on.
MAX_DIM = 1 << 20


@dataclass(frozen=True)
class DimRange:
    """The sizes a symbolic dimension may take, inclusive. A dim declared as a sum of
    others (``total_seq = "past_seq + seq"``) has its ``parts``: its size is always theirs
    added, and its range follows from theirs."""

    min: int
    max: int
    parts: tuple[str, ...] = ()

    def to_toml(self) -> dict[str, int] | str:
        """The form a spec file writes: ``{min, max}``, or the sum's expression."""
        return " + ".join(self.parts) if self.parts else {"min": self.min, "max": self.max}


@dataclass(frozen=True)
class Guard:
    """A condition on the dims that an export accepted (``accept_guards``): the graph follows
    the module's code only where it holds. ``points`` are sizes of the free dims, inside the
    declared range, where it does not: the module may compute something else there, so
    build's smoke check and verify's sweep run them."""

    #: In the spec's dim names: ``seq != 7``.
    condition: str
    #: The module's source line that made it (``file:line `code```), where torch named one.
    where: str = ""
    points: tuple[dict[str, int], ...] = ()

    def describe(self) -> str:
        return self.condition + (f" (at {self.where})" if self.where else " (assumed by torch's trace, at no line)")

    def fails_at(self, sizes: Mapping[str, int]) -> bool:
        """Whether ``sizes`` (sums included or not) is one of the points where it fails."""
        return any(all(sizes.get(k) == v for k, v in p.items()) for p in self.points)

    def to_dict(self) -> dict[str, Any]:
        return {"condition": self.condition, "where": self.where, "points": [dict(p) for p in self.points]}


def concrete_shape(tensor: TensorSpec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Replace symbolic dims with sizes."""
    return tuple(d if isinstance(d, int) else sizes[d] for d in tensor.shape)


@dataclass(frozen=True)
class TensorSpec:
    """A named input or output: dtype and shape, where a string is a symbolic dim."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    #: For mask inputs: pattern, layout and convention (``masks.MaskSpec``).
    mask: MaskSpec | None = None
    #: For inputs: the forward() keyword it is passed as; None passes it by position.
    arg: str | None = None
    #: For outputs: the index or name it is taken from when the module returns several.
    pick: int | str | None = None
    #: For a 2-D mask input: how the adapter expands it for the module (``masks.EXPANSIONS``).
    expand: str | None = None
    #: For an integer input (token ids): the least and greatest value drawn, as declared.
    values: tuple[int, int] | None = None

    @property
    def is_ids(self) -> bool:
        """An integer input drawn from a range of values (token ids, positions), not a mask."""
        return self.dtype.startswith("int") and self.mask is None

    def stray_nonfinite(self, values: Any) -> str | None:
        """Why float ``values`` of this input are not ones verify feeds (NaN or Inf, besides
        the -inf fill of its mask's convention); None where they are, or are not floats."""
        if values.dtype.kind != "f":
            return None
        convention = self.mask.convention if self.mask is not None else None
        if np.isfinite(values).all() if convention is None else convention.admits(values):
            return None
        infinite = convention is not None and convention.infinite_fill
        allowed = f" (an {convention.name} mask may hold -inf, nothing else)" if infinite and convention else ""
        return f"input '{self.name}' holds NaN or Inf{allowed}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.mask is not None:
            d.update(self.mask.to_dict())
        for key in ("arg", "pick", "expand"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.values is not None:
            d["values"] = {"min": self.values[0], "max": self.values[1]}
        return d


@dataclass(frozen=True)
class WeightsSpec:
    """Where the weights come from: a seeded random init, or a state_dict file."""

    seed: int = 0
    #: A state_dict saved with torch.save (absolute when read from a spec file; as recorded,
    #: relative to the spec's folder, when read from a manifest); None means seeded init.
    path: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to build, feed and judge one model."""

    name: str
    module: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: dict[str, DimRange]
    kwargs: dict[str, Any] = field(default_factory=dict)
    opset: int = 18
    exporter: str = "dynamo"
    mode: str = "eval"
    weights: WeightsSpec = field(default_factory=WeightsSpec)
    tolerance: Tolerance = field(default_factory=lambda: Tolerance(1e-5, 1e-4))
    output_tolerances: dict[str, Tolerance] = field(default_factory=dict)
    #: Tolerances for graph variants (int8, fp16, ...), replacing the model's own.
    variant_tolerances: dict[str, Tolerance] = field(default_factory=dict)
    #: The shape that matters most in deployment; ``build --variant auto`` times graphs here.
    typical: dict[str, int] = field(default_factory=dict)
    description: str = ""
    #: Build even where the module's Python code narrows a declared range or freezes a
    #: traced value (the export then holds only for part of the range; verify judges it).
    accept_guards: bool = False
    #: A config object built first and passed as ``config=``: its class and its kwargs.
    config: dict[str, Any] | None = None
    #: Extra forward() keywords: plain values, or tables computing them (``exporter.adapter``).
    call: dict[str, Any] = field(default_factory=dict)
    #: "match": fully masked rows must give PyTorch's result; "ignore": they are not compared.
    fully_masked: str = "match"
    #: The spec file's folder: searched first when importing ``module``. Only ever set from
    #: a spec file in the checkout, never from a manifest.
    search_path: str | None = None
    #: Memory budget (bytes) for one verify case; None means this machine's memory.
    max_memory: int | None = None
    #: ``[cache] max_seq``: the capacity of a cache buffer updated in place (``static-cache``).
    cache_max_seq: int | None = None
    #: ``[cache] window``: the positions each present of a sliding-window KV cache keeps
    #: (the newest); None: a cache that keeps every position (``model_spec.cache``).
    cache_window: int | None = None
    #: ``[cache] extend_batch``: the largest batch at which one step brings several new tokens
    #: to a filled cache (onnxruntime-genai's GroupQueryAttention on CPU: 1); None: any.
    cache_extend_batch: int | None = None
    #: What the build's export accepted: set by build, never by a spec file.
    guards: tuple[Guard, ...] = ()
    #: The least and greatest value of each integer input without declared ``values`` that
    #: lands on a row of every table it indexes, read from the module by build
    #: (``exporter.index_inputs``), never by a spec file.
    vocab: dict[str, tuple[int, int]] = field(default_factory=dict)

    def tolerance_for(self, output: str, variant: str = "fp32") -> Tolerance:
        """A variant's own tolerance (the spec's for that very name, else the table's
        default), else the output's. A chain's, unless the spec names the chain, is its
        links' tolerances composed in order (``Tolerance.then``): a link without one of its
        own (``attention-op``) counts with the output's.

        ``auto`` only ever chooses a graph within the model's own tolerance, so it is
        judged at it."""
        if variant in self.variant_tolerances:
            return self.variant_tolerances[variant]
        chain = variant_chain(variant)
        return functools.reduce(Tolerance.then, (self._link_tolerance(output, link) for link in chain.links))

    def _link_tolerance(self, output: str, info: VariantInfo) -> Tolerance:
        """One link's tolerance: the spec's for that name, else the table's, else the output's
        (a link that cannot be made alone, ``gqa-rotary``, is read as a link, not a variant)."""
        if info.name in self.variant_tolerances:
            return self.variant_tolerances[info.name]
        if not info.chooser and info.tolerance is not None:
            return dataclasses.replace(info.tolerance, allow_nan=self.tolerance.allow_nan)
        return self.output_tolerances.get(output, self.tolerance)

    def tolerances(self, variant: str = "fp32") -> dict[str, Tolerance]:
        """Every output's tolerance for ``variant``."""
        return {t.name: self.tolerance_for(t.name, variant) for t in self.outputs}

    def simulated_tolerances(self, variant: str) -> dict[str, Tolerance] | None:
        """Every output's tolerance against the module run with int4's rounding, where a
        ``variant`` with an int4 link is judged so (``tolerance.on_a_cpu``): its other links'
        composed (the output's own where none is left), as if int4 took nothing away. None
        where the chain has no int4 link, or the spec names a tolerance for int4 or for the
        chain itself: the user's room then judges."""
        exact = {t.name: self.simulated_tolerance(t.name, variant) for t in self.outputs}
        tolerances = {name: tol for name, tol in exact.items() if tol is not None}
        return tolerances if len(tolerances) == len(exact) else None

    def simulated_tolerance(self, output: str, variant: str) -> Tolerance | None:
        """One output's tolerance against the module with int4's rounding
        (``simulated_tolerances``; ``""``: the spec's own, as ``tolerance_for`` reads it)."""
        links = variant_chain(variant).links
        if all(link.name != "int4" for link in links) or {"int4", variant} & set(self.variant_tolerances):
            return None
        rest = [link for link in links if link.name != "int4"]
        if not rest:
            return self.output_tolerances.get(output, self.tolerance)
        return functools.reduce(Tolerance.then, (self._link_tolerance(output, r) for r in rest))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready, portable form (no absolute paths); ``spec_from_dict`` reads it back.

        Where the spec lives is not part of it: a weights path is written relative to the
        spec's folder, and the folder itself is left out."""
        weights = asdict(self.weights)
        if self.weights.path is not None and self.search_path is not None:
            weights["path"] = os.path.relpath(self.weights.path, self.search_path)
        sizes = {"max_seq": self.cache_max_seq, "window": self.cache_window, "extend_batch": self.cache_extend_batch}
        cache = {k: v for k, v in sizes.items() if v is not None}
        return (
            {
                "name": self.name,
                "description": self.description,
                "module": self.module,
                "kwargs": self.kwargs,
                "inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs],
                "dims": {k: v.to_toml() for k, v in self.dims.items()},
                "opset": self.opset,
                "exporter": self.exporter,
                "mode": self.mode,
                "weights": weights,
                "tolerance": {
                    **_tolerance_dict(self.tolerance),
                    "outputs": {k: _tolerance_dict(v) for k, v in self.output_tolerances.items()},
                },
                "variants": {k: _tolerance_dict(v) for k, v in self.variant_tolerances.items()},
                "typical": dict(self.typical),
                "accept_guards": self.accept_guards,
                **({"config": self.config} if self.config is not None else {}),
                **({"call": self.call} if self.call else {}),
                **({"fully_masked": self.fully_masked} if self.fully_masked != "match" else {}),
            }
            | ({"max_memory": self.max_memory} if self.max_memory else {})
            | ({"cache": cache} if cache else {})
            | ({"guards": [g.to_dict() for g in self.guards]} if self.guards else {})
            | ({"vocab": {k: list(v) for k, v in self.vocab.items()}} if self.vocab else {})
        )

    @property
    def free_dims(self) -> dict[str, DimRange]:
        """The dims whose sizes are chosen; the others are sums of these."""
        return {k: r for k, r in self.dims.items() if not r.parts}

    def with_sums(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """``sizes`` of the free dims, with every sum dim's size added."""
        out = {k: int(v) for k, v in sizes.items() if k in self.dims and not self.dims[k].parts}
        return out | {k: sum(out[p] for p in r.parts) for k, r in self.dims.items() if r.parts}

    @property
    def masks(self) -> tuple[tuple[TensorSpec, MaskSpec], ...]:
        """The mask inputs, each with its ``MaskSpec``."""
        return tuple((t, t.mask) for t in self.inputs if t.mask is not None)

    def content_hash(self) -> str:
        """sha256 of what determines the exported graph: the spec's content and the weights
        file's bytes (not where either lives). Needs the weights file."""
        d = self.to_dict()
        d.pop("description")
        d.pop("max_memory", None)
        d.pop("guards", None)  # learnt from the export, not a cause of it
        d.pop("vocab", None)  # learnt from the module
        if self.weights.path is not None:
            d["weights"]["path"] = _file_sha256(Path(self.weights.path))
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def _tolerance_dict(t: Tolerance) -> dict[str, Any]:
    """atol and rtol, and allow_nan, atol_rms and rms_rtol only where set, so specs without
    them keep their hashes."""
    return (
        {"atol": t.atol, "rtol": t.rtol}
        | ({"allow_nan": True} if t.allow_nan else {})
        | ({"atol_rms": t.atol_rms} if t.atol_rms else {})
        | ({"rms_rtol": t.rms_rtol} if t.rms_rtol else {})
    )


def _file_sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise SpecError(f"cannot read weights file {path}: {e.strerror}") from e
