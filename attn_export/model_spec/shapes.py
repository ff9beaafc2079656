"""Concrete sizes for symbolic dims: export examples, verification sweeps, and --shapes parsing.

The trap this module exists for: example inputs that share a size let the exporter merge
two symbolic dims into one. Examples here give every dim its own size, and sweeps always
include points where the query and key/value lengths differ.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from attn_export.errors import InputError, OptionError
from attn_export.model_spec.cache import check_fed_sizes, fed_points, fed_sizes
from attn_export.model_spec.distributions import DEFAULT, DISTRIBUTIONS
from attn_export.model_spec.masks import CASES, FULL, PATTERN, case_applies
from attn_export.model_spec.model import DimRange, ModelSpec, TensorSpec

__all__ = [
    "ShapePoint",
    "corner_points",
    "example_sizes",
    "format_sizes",
    "golden_plan",
    "golden_points",
    "mask_cases",
    "parse_shapes",
    "sizes_from_feeds",
    "sweep",
]

_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71)


@dataclass(frozen=True)
class ShapePoint:
    """One assignment of sizes to a model's symbolic dims, with a label saying why."""

    label: str
    sizes: dict[str, int] = field(hash=False)
    #: ``masks.PATTERN``, or the named mask case (``masks.CASES``) the point feeds.
    case: str = PATTERN

    def describe(self) -> str:
        return format_sizes(self.sizes)


def format_sizes(sizes: Mapping[str, int]) -> str:
    """Sizes as reports and commands write them: ``batch=2,seq=5``."""
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def _candidates(rng: DimRange, taken: set[int]) -> list[int]:
    """Sizes a dim may take at export, primes first (>= 2: 0 and 1 are special-cased)."""
    lo = max(rng.min, 2)
    primes = [p for p in _PRIMES if lo <= p <= rng.max]
    return [n for n in primes + [n for n in range(lo, min(rng.max, lo + 256) + 1) if n not in primes] if n not in taken]


def example_sizes(spec: ModelSpec) -> dict[str, int]:
    """Distinct sizes (>= 2, not equal to any static dim) for every symbolic dim, sums
    included, for export: no two dims may share a size, or the exporter merges them."""
    static = {d for t in spec.inputs + spec.outputs for d in t.shape if isinstance(d, int)}
    taken: set[int] = set(static)
    sizes: dict[str, int] = {}
    free = list(spec.free_dims.items())
    for i, (name, rng) in enumerate(free):
        options = _candidates(rng, taken)
        # The last part of a sum tries further sizes until the sums are distinct too.
        for choice in options if i == len(free) - 1 else options[:1]:
            trial = spec.with_sums(sizes | {name: choice}) if i == len(free) - 1 else {}
            sums = [v for k, v in trial.items() if spec.dims[k].parts]
            if len(set(sums)) == len(sums) and not set(sums) & (taken | {choice}):
                sizes[name] = choice
                break
        if name not in sizes:
            held = [f"{n} in the shapes" for n in sorted(static)] + [f"{d} = {n}" for d, n in sizes.items()]
            summed = [d for d in spec.dims if spec.dims[d].parts]
            if i == len(free) - 1 and summed:
                held.append(f"and the sums {', '.join(summed)} of each size tried")
            raise InputError(
                f"{spec.name}: no example size for dim '{name}' in [{rng.min}, {rng.max}] "
                f"differs from the other dims and their sums (taken: {', '.join(held)}); widen its range: "
                "the exporter merges two dims of one size"
            )
        taken.add(sizes[name])
    return spec.with_sums(sizes)


def _fed(spec: ModelSpec, sizes: Mapping[str, int]) -> dict[str, int]:
    """``sizes`` as the graph is fed them (``cache.fed_sizes``: a cache's ``extend_batch``)."""
    return fed_sizes(spec, sizes)


def _fed_points(spec: ModelSpec) -> dict[str, dict[str, int]]:
    """The prompt and the step a generator feeds at the largest batch (``cache.fed_points``)."""
    return fed_points(spec, example_sizes(spec))


def _clamp(spec: ModelSpec, sizes: Mapping[str, int], cap: int | None) -> dict[str, int]:
    """The free dims of ``sizes``, each at most ``cap``, with the sum dims added, as fed."""
    dims = spec.free_dims  # the sums are computed anew from the capped dims
    return _fed(spec, {k: v if cap is None else max(dims[k].min, min(v, cap)) for k, v in sizes.items() if k in dims})


def mask_cases(spec: ModelSpec) -> list[str]:
    """The named mask cases that apply to ``spec``'s masks (none without a mask, or where
    every mask keeps every key)."""
    return [c for c in CASES if any(m.pattern != FULL and case_applies(c, m.layout, t.shape) for t, m in spec.masks)]


def check_mask_case(spec: ModelSpec, case: str | None, label: str) -> None:
    """OptionError when ``case`` (option ``mask_case``) names a case none of ``spec``'s masks has."""
    if case and case not in mask_cases(spec):
        cases = ", ".join(mask_cases(spec)) or "none"
        none = f"{{label}}: {{mask_case}} {{value}} does not apply (it has: {cases})"
        raise OptionError(none, ["mask_case"], label=label, value=case)


def _mask_points(spec: ModelSpec, sizes: dict[str, int]) -> list[ShapePoint]:
    """Each named mask case at ``sizes``, labelled by the case: its own case, never mixed in."""
    return [ShapePoint(case, dict(sizes), case) for case in mask_cases(spec)]


def _guard_points(spec: ModelSpec) -> list[ShapePoint]:
    """Where an accepted guard does not hold (``Guard.points``): the graph may go wrong there."""
    points = [{k: p[k] for k in spec.free_dims} for g in spec.guards for p in g.points]  # in the spec's order
    return [ShapePoint(f"guard-{i}", spec.with_sums(p)) for i, p in enumerate(points, 1)]


def sweep(spec: ModelSpec, *, n_random: int = 2, seed: int = 0, cap: int | None = None) -> list[ShapePoint]:
    """The default verification sweep: minimum sizes, distinct sizes, maximum sizes,
    skewed points where neighbouring dims sit at opposite ends (query length != kv length),
    the points where an accepted guard fails, seeded random points, then the named mask
    cases at the distinct sizes. Duplicates are
    dropped; ``cap`` bounds every size for slow runtimes.
    """
    dims = spec.free_dims
    names = list(dims)
    candidates = [
        ShapePoint("min", {k: r.min for k, r in dims.items()}),
        ShapePoint("distinct", example_sizes(spec)),
        ShapePoint("max", {k: r.max for k, r in dims.items()}),
        ShapePoint("skew-a", {k: (dims[k].max if i % 2 else dims[k].min) for i, k in enumerate(names)}),
        ShapePoint("skew-b", {k: (dims[k].min if i % 2 else dims[k].max) for i, k in enumerate(names)}),
        *_guard_points(spec),
        *(ShapePoint(label, sizes) for label, sizes in _fed_points(spec).items()),
    ]
    rng = random.Random(seed)
    candidates += [
        ShapePoint(f"random-{i}", {k: rng.randint(r.min, r.max) for k, r in dims.items()}) for i in range(n_random)
    ]
    points: list[ShapePoint] = []
    seen: set[tuple[int, ...]] = set()
    for p in candidates:
        sizes = _clamp(spec, p.sizes, cap)
        key = tuple(sizes[k] for k in names)
        if key not in seen:
            seen.add(key)
            points.append(ShapePoint(p.label, sizes))
    extra = 0
    while len(points) < 6 and extra < 100:
        sizes = _clamp(spec, {k: rng.randint(r.min, r.max) for k, r in dims.items()}, cap)
        key = tuple(sizes[k] for k in names)
        extra += 1
        if key not in seen:
            seen.add(key)
            points.append(ShapePoint(f"random-{n_random + extra}", sizes))
    return points + _mask_points(spec, _clamp(spec, example_sizes(spec), cap))


def corner_points(spec: ModelSpec) -> list[ShapePoint]:
    """The corners of the declared range: every dim at its min or its max (all 2^n mixes
    up to four dims; beyond, all-min, all-max and each dim alone at the other end)."""
    dims = spec.free_dims
    names = list(dims)
    if len(names) <= 4:
        mixes = list(itertools.product((False, True), repeat=len(names)))
    else:
        mixes = [(False,) * len(names), (True,) * len(names)]
        mixes += [tuple(j == i for j in range(len(names))) for i in range(len(names))]
        mixes += [tuple(j != i for j in range(len(names))) for i in range(len(names))]
    points = []
    for mix in mixes:
        label = (
            "max" if all(mix) else "min" if not any(mix) else "corner-" + "-".join("max" if m else "min" for m in mix)
        )
        points.append(
            ShapePoint(
                label,
                spec.with_sums({k: (dims[k].max if m else dims[k].min) for k, m in zip(names, mix, strict=True)}),
            )
        )
    return points


def golden_plan(spec: ModelSpec) -> list[tuple[ShapePoint, str]]:
    """Each shape build records, with its values' distribution: every golden point
    (``golden_points``) with unit-normal values, the distinct one with each other
    distribution too (those are verify's to judge)."""
    points = golden_points(spec)
    plan = [(p, DEFAULT) for p in points]
    return plan + [(p, d) for d in DISTRIBUTIONS if d != DEFAULT for p in points if p.label == "distinct"]


def golden_points(spec: ModelSpec) -> list[ShapePoint]:
    """The shapes build smoke-checks and records as golden vectors: distinct sizes, the
    points where an accepted guard fails, every corner of the declared range, and a long
    point; so ``verify --golden`` covers the range's ends as the PyTorch sweep does. The long
    point keeps the batch at its least, the others at 64 where they reach it: the dim named
    ``batch``, else the first input's leading dim, else the dim of the smallest range. Never
    the first the spec declares: a manifest holds its spec's dims sorted, and the point was a
    corner at build and a shape of its own at verify, which then refused every such build.
    For the same reason its distinct sizes are those of the dims in name order (``_unordered_example``)."""
    example = _unordered_example(spec)
    dims = spec.free_dims
    leading = next((t.shape[0] for t in spec.inputs if t.shape and isinstance(t.shape[0], str)), None)
    smallest = min(dims, key=lambda k: (dims[k].max, k), default=None)
    first = "batch" if "batch" in dims else leading if leading in dims else smallest
    long = {k: dims[k].min if k == first else min(r.max, max(r.min, 64)) for k, r in dims.items()}
    points = [
        ShapePoint("distinct", example),
        *_guard_points(spec),  # before the corners: a smoke check that fails there names the guard
        *corner_points(spec),
        *(ShapePoint(label, sizes) for label, sizes in fed_points(spec, example).items()),
        ShapePoint("long", spec.with_sums(long)),
    ]
    unique: dict[tuple[int, ...], ShapePoint] = {}
    for p in points:
        fed = _fed(spec, p.sizes)
        unique.setdefault(tuple(fed.values()), ShapePoint(p.label, fed, p.case))
    return list(unique.values()) + _mask_points(spec, _fed(spec, example))


def _unordered_example(spec: ModelSpec) -> dict[str, int]:
    """``example_sizes`` of the dims in name order, as a manifest holds them, in the spec's
    order: the sizes follow the dims' order, and verify asks a golden file for the points of
    the manifest's copy, so a point made from them (an ``extend_batch`` spec's ``step``) was
    a guard's point at build and one of its own at verify, which refused every such build."""
    sizes = example_sizes(dataclasses.replace(spec, dims=dict(sorted(spec.dims.items()))))
    return {k: sizes[k] for k in spec.dims if k in sizes}


def validate_sizes(spec: ModelSpec, sizes: Mapping[str, int]) -> None:
    """Refuse unknown dims, missing dims, sizes outside the declared range and a sum dim
    given a size other than its parts' sum (it may be left out)."""
    for k, v in sizes.items():
        if k not in spec.dims:
            raise InputError(f"{spec.name}: unknown dim '{k}' (dims: {', '.join(spec.dims)})")
        r = spec.dims[k]
        if not r.min <= v <= r.max:
            raise InputError(f"{spec.name}: {k}={v} is outside its declared range [{r.min}, {r.max}]")
    missing = [k for k in spec.free_dims if k not in sizes]
    if missing:
        raise InputError(f"{spec.name}: no size given for dim {', '.join(missing)}")
    for k, v in spec.with_sums(sizes).items():
        if k in sizes and sizes[k] != v:
            raise InputError(f"{spec.name}: {k}={sizes[k]}, but {k} = {' + '.join(spec.dims[k].parts)} = {v}")
    check_fed_sizes(spec, sizes)


def parse_shapes(text: str) -> list[dict[str, int]]:
    """Parse ``--shapes "batch=1,seq=3,kv_seq=9;batch=2,seq=5,kv_seq=7"``."""
    points: list[dict[str, int]] = []
    for chunk in filter(None, (c.strip() for c in text.split(";"))):
        sizes: dict[str, int] = {}
        for item in chunk.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            digits = value.strip()
            if not sep or not key or not (digits.isascii() and digits.isdigit()):  # '²'.isdigit(), but int('²') fails
                raise InputError(f"--shapes: cannot read {item.strip()!r}; expected NAME=SIZE, e.g. seq=16")
            sizes[key] = int(value)
        points.append(sizes)
    if not points:
        raise InputError("--shapes: no shape given")
    return points


def sizes_from_feeds(inputs: Sequence[TensorSpec], shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """Read each symbolic dim's size off concrete input shapes; a dim seen with two sizes is an error."""
    sizes: dict[str, int] = {}
    for t in inputs:
        shape = shapes[t.name]
        for axis, d in enumerate(t.shape):
            if isinstance(d, str):
                if d in sizes and sizes[d] != shape[axis]:
                    raise InputError(
                        f"dim '{d}' has two sizes: {sizes[d]} and {shape[axis]} (input '{t.name}', axis {axis})"
                    )
                sizes[d] = int(shape[axis])
    return sizes
