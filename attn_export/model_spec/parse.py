"""TOML model specs -> validated ``ModelSpec``: one small parser per table.

Every problem is a SpecError naming the file and, where it can be told exactly, the line:
a key's line when the key occurs once in the file, else the line of its table's header.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attn_export.errors import SpecError, UsageError
from attn_export.model_spec.cache import cache_of
from attn_export.model_spec.masks import CONVENTIONS, EXPANSIONS, LAYOUTS, Convention, MaskSpec, default_layout
from attn_export.model_spec.memory import parse_bytes
from attn_export.model_spec.model import (
    DTYPES,
    EXPORTERS,
    FULLY_MASKED,
    MASK_KINDS,
    MAX_DIM,
    MODES,
    DimRange,
    Guard,
    ModelSpec,
    TensorSpec,
    WeightsSpec,
)
from attn_export.model_spec.tolerance import Tolerance
from attn_export.model_spec.variants import CHAIN, VARIANTS, Chain, variant_chain

__all__ = ["load_spec", "spec_from_dict", "spec_paths"]

_TOP_KEYS = {
    "description",
    "module",
    "kwargs",
    "inputs",
    "outputs",
    "dims",
    "opset",
    "exporter",
    "mode",
    "weights",
    "tolerance",
    "variants",
    "typical",
    "accept_guards",
    "max_memory",
    "config",
    "call",
    "fully_masked",
    "cache",
}
_TENSOR_KEYS = {"name", "dtype", "shape"}
_INPUT_KEYS = _TENSOR_KEYS | {"mask", "convention", "layout", "arg", "expand", "values"}
_OUTPUT_KEYS = _TENSOR_KEYS | {"pick"}
_OBJECT = re.compile(r"[\w.]+:[\w.]+")
_DIM_KEYS = {"min", "max"}
_WEIGHT_KEYS = {"seed", "path"}
_TOL_KEYS = {"atol", "rtol", "atol_rms", "rms_rtol", "allow_nan", "outputs"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Variants a spec may give a tolerance for (and chains of them): ``auto`` is judged at the model's own.
_TOLERANCE_VARIANTS = tuple(n for n, v in VARIANTS.items() if not v.chooser)


class _Where:
    """Error messages naming the spec file and, when it can be told exactly, a line."""

    def __init__(self, path: Path | None, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

    def _key_lines(self, key: str) -> list[int]:
        pattern = re.compile(rf"(^|[{{,])\s*(\"{re.escape(key)}\"|{re.escape(key)})\s*=")
        return [i for i, line in enumerate(self.lines, 1) if pattern.search(line.split("#", 1)[0])]

    def _table_line(self, table: str, index: int = 0) -> int | None:
        header = re.compile(rf"^\s*\[\[?\s*{re.escape(table)}\s*\]\]?\s*(#.*)?$")
        hits = [i for i, line in enumerate(self.lines, 1) if header.match(line)]
        return hits[index] if index < len(hits) else None

    def error(self, message: str, key: str | None = None, table: str | None = None, index: int = 0) -> SpecError:
        where = str(self.path) if self.path else "<spec>"
        line = None
        if key is not None:
            hits = self._key_lines(key)
            line = hits[0] if len(hits) == 1 else None
        if line is None and table is not None:
            line = self._table_line(table, index)
        if line is not None and self.lines:
            where += f":{line}"
        return SpecError(f"{where}: {message}")


def _check_keys(where: _Where, table: dict[str, Any], allowed: set[str], context: str, header: str | None) -> None:
    for key in table:
        if key not in allowed:
            raise where.error(
                f"unknown key '{key}' in {context} (expected one of: {', '.join(sorted(allowed))})", key, header
            )


def _int(where: _Where, value: Any, what: str, key: str, table: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.error(f"{what} must be an integer, got {value!r}", key, table)
    return value


def _number(where: _Where, value: Any, what: str, key: str, table: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
        raise where.error(f"{what} must be a finite non-negative number, got {value!r}", key, table)
    return float(value)


def _bool(where: _Where, value: Any, what: str, key: str, table: str | None = None) -> bool:
    if not isinstance(value, bool):
        raise where.error(f"{what} must be true or false, got {value!r}", key, table)
    return value


def _table(where: _Where, raw: dict[str, Any], key: str, what: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise where.error(f"'{key}' must be {what}", key)
    return value


def _tolerance_table(where: _Where, raw: Any, default: Tolerance, context: str, key: str) -> Tolerance:
    """An {atol, rtol} table; a missing value falls back to ``default``."""
    if not isinstance(raw, dict):
        raise where.error(f"{context} must be a table with atol and rtol", key, context)
    _check_keys(where, raw, {"atol", "rtol", "atol_rms", "rms_rtol", "allow_nan"}, context, context)
    return Tolerance(
        _number(where, raw.get("atol", default.atol), f"{context}.atol", "atol", context),
        _number(where, raw.get("rtol", default.rtol), f"{context}.rtol", "rtol", context),
        _bool(where, raw.get("allow_nan", default.allow_nan), f"{context}.allow_nan", "allow_nan", context),
        _number(where, raw.get("atol_rms", default.atol_rms), f"{context}.atol_rms", "atol_rms", context),
        _number(where, raw.get("rms_rtol", default.rms_rtol), f"{context}.rms_rtol", "rms_rtol", context),
        default.int8_rounding,
        default.weight_bits,
    )


#: A mask input's keys as written: pattern, convention, and the layout if one is given.
_MaskKeys = tuple[str, Convention, str | None]


def _mask_keys(
    bad: Callable[..., SpecError], raw: dict[str, Any], name: str, dtype: str, rank: int
) -> _MaskKeys | None:
    """The mask keys of one input: pattern, convention (default True = attend for bool) and
    an explicit layout (else resolved from the rank in ``_resolve_layouts``)."""
    mask, convention, layout = raw.get("mask"), raw.get("convention"), raw.get("layout")
    if mask is None:
        for key in ("convention", "layout"):
            if key in raw:
                raise bad(f"input '{name}': '{key}' applies to masks; add mask = one of {', '.join(MASK_KINDS)}", key)
        return None
    if mask not in MASK_KINDS:
        raise bad(f"input '{name}': mask {mask!r} is not one of {', '.join(MASK_KINDS)}", "mask")
    if convention is None and dtype != "bool":
        fits = [c.name for c in CONVENTIONS.values() if dtype in c.dtypes]
        raise bad(f"input '{name}': a {dtype} mask needs a convention ({', '.join(fits)})", "mask")
    convention = convention or "attend"
    if convention not in CONVENTIONS:
        raise bad(f"input '{name}': convention {convention!r} is not one of {', '.join(CONVENTIONS)}", "convention")
    if dtype not in CONVENTIONS[convention].dtypes:
        allowed = ", ".join(CONVENTIONS[convention].dtypes)
        raise bad(
            f"input '{name}': a mask with convention {convention!r} must have dtype {allowed}, not {dtype}", "dtype"
        )
    if layout is not None and (layout not in LAYOUTS or len(LAYOUTS[layout]) != rank):
        fits = [k for k, roles in LAYOUTS.items() if len(roles) == rank]
        raise bad(f"input '{name}': layout {layout!r} does not fit its {rank} dims (fits: {', '.join(fits)})", "layout")
    if rank < 2 or rank > 4:
        raise bad(
            f"input '{name}': a mask needs 2 to 4 dims ([batch, kv_seq] ... [batch, heads, seq, kv_seq])", "shape"
        )
    return mask, CONVENTIONS[convention], layout


def _pick(bad: Callable[..., SpecError], raw: dict[str, Any], name: str) -> int | str | None:
    pick = raw.get("pick")
    ok_index = isinstance(pick, int) and not isinstance(pick, bool) and pick >= 0
    if pick is not None and not ok_index and not (isinstance(pick, str) and _NAME.fullmatch(pick)):
        raise bad(f"output '{name}': pick must be an index (0, 1, ...) or an attribute name, got {pick!r}", "pick")
    return pick  # type: ignore[no-any-return]


def _tensor(where: _Where, raw: Any, kind: str, index: int) -> tuple[TensorSpec, _MaskKeys | None]:
    context, is_input = f"{kind}[{index}]", kind == "inputs"

    def bad(message: str, key: str | None = None) -> SpecError:
        return where.error(message, key, kind, index)

    if not isinstance(raw, dict):
        raise bad(f"{context} must be a table with name, dtype and shape")
    allowed = _INPUT_KEYS if is_input else _OUTPUT_KEYS
    for key in raw:
        if key not in allowed:
            raise bad(f"unknown key '{key}' in {context} (expected one of: {', '.join(sorted(allowed))})", key)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{context} needs a non-empty string 'name'", "name")
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        raise bad(f"{context} '{name}': dtype {dtype!r} is not one of {', '.join(DTYPES)}", "dtype")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not shape:
        raise bad(f"{context} '{name}': 'shape' must be a non-empty list", "shape")
    for dim in shape:
        ok_static = isinstance(dim, int) and not isinstance(dim, bool) and 0 < dim <= MAX_DIM
        ok_symbolic = isinstance(dim, str) and _NAME.fullmatch(dim)
        if not (ok_static or ok_symbolic):
            raise bad(f"{context} '{name}': dim {dim!r} must be a positive integer or a dim name", "shape")
    if not is_input:
        return TensorSpec(name, dtype, tuple(shape), pick=_pick(bad, raw, name)), None
    arg = raw.get("arg")
    if arg is not None and not (isinstance(arg, str) and _NAME.fullmatch(arg)):
        raise bad(f"input '{name}': arg must be a forward() keyword name, got {arg!r}", "arg")
    keys = _mask_keys(bad, raw, name, dtype, len(shape))
    values = _values(where, raw, name, dtype, keys, index)
    return TensorSpec(name, dtype, tuple(shape), arg=arg, expand=_expand(bad, raw, name, keys), values=values), keys


def _values(
    where: _Where, raw: dict[str, Any], name: str, dtype: str, keys: _MaskKeys | None, index: int
) -> tuple[int, int] | None:
    """``values = { min, max }``: the range an integer input (token ids) is drawn from."""
    table = raw.get("values")
    if table is None:
        return None
    if not dtype.startswith("int") or keys is not None:
        raise where.error(
            f"input '{name}': values applies to an integer input that is not a mask", "values", "inputs", index
        )
    if not isinstance(table, dict) or set(table) != {"min", "max"}:
        raise where.error(
            f"input '{name}': values must be a table like {{ min = 0, max = 999 }}", "values", "inputs", index
        )
    lo = _int(where, table["min"], f"input '{name}': values.min", "values", "inputs")
    hi = _int(where, table["max"], f"input '{name}': values.max", "values", "inputs")
    bits = int(dtype.removeprefix("int"))
    if not -(2 ** (bits - 1)) <= lo <= hi < 2 ** (bits - 1):
        raise where.error(f"input '{name}': values {lo}..{hi} is empty or outside {dtype}", "values", "inputs", index)
    return lo, hi


def _expand(bad: Callable[..., SpecError], raw: dict[str, Any], name: str, keys: _MaskKeys | None) -> str | None:
    """``expand``: only for a 2-D mask that holds 1 (or True) where a token is real."""
    expand = raw.get("expand")
    if expand is None:
        return None
    if expand not in EXPANSIONS:
        raise bad(f"input '{name}': expand {expand!r} is not one of {', '.join(EXPANSIONS)}", "expand")
    if keys is None or keys[2] not in (None, "key-padding") or len(raw["shape"]) != 2:
        raise bad(f"input '{name}': expand applies to a 2-D [batch, seq] mask, as a tokenizer gives it", "expand")
    if keys[1].name not in ("binary", "attend"):
        raise bad(f"input '{name}': expand takes a tokenizer's mask, convention 'binary' (or 'attend')", "expand")
    return str(expand)


def _resolve_layouts(where: _Where, inputs: list[tuple[TensorSpec, _MaskKeys | None]]) -> tuple[TensorSpec, ...]:
    """Give every mask its ``MaskSpec``, the layout resolved from its rank and the other
    inputs' dims where not given (``masks.default_layout``)."""
    others = [t.shape for t, keys in inputs if keys is None]
    resolved = []
    for i, (t, keys) in enumerate(inputs):
        if keys is not None:
            pattern, convention, given = keys
            layout = given or default_layout(t.shape, others, pattern)
            assert layout is not None  # the rank was checked
            if pattern == "causal" and "query" not in LAYOUTS[layout]:
                hint = (
                    ""
                    if given
                    else f" (read from its dims: its first dim '{t.shape[0]}' was taken for the batch; "
                    'for a [seq, kv_seq] mask set layout = "query-key")'
                )
                raise where.error(
                    f"input '{t.name}': a causal mask needs a query axis; {layout} has none{hint}", "mask", "inputs", i
                )
            t = dataclasses.replace(t, mask=MaskSpec(pattern, layout, convention))
        resolved.append(t)
    return tuple(resolved)


def _tensors(where: _Where, raw: dict[str, Any], kind: str) -> tuple[TensorSpec, ...]:
    items = raw.get(kind)
    if not isinstance(items, list) or not items:
        raise where.error(f"the spec needs at least one [[{kind}]] entry", kind)
    tensors = [_tensor(where, t, kind, i) for i, t in enumerate(items)]
    if kind == "inputs":
        return _resolve_layouts(where, tensors)
    outputs = tuple(t for t, _ in tensors)
    picks = [t.pick is not None for t in outputs]
    if any(picks) and not all(picks):
        raise where.error("either every output has 'pick' or none has", "pick", "outputs")
    return outputs


def _dims(where: _Where, raw: dict[str, Any]) -> dict[str, DimRange]:
    """``name = { min, max }`` (min may be 0: an empty KV cache), or ``name = "a + b"``: a
    dim whose size is the sum of others (``total_seq = "past_seq + seq"``)."""
    dims: dict[str, DimRange] = {}
    sums: dict[str, str] = {}
    for name, rng in _table(where, raw, "dims", "a table of {min, max} ranges").items():
        context = f"dims.{name}"

        def bad(message: str, name: str = name) -> SpecError:
            return where.error(f"dim '{name}': {message}", name, "dims")

        if not _NAME.fullmatch(name):
            raise bad("a dim name must be letters, digits and '_'")
        if isinstance(rng, str):
            sums[name] = rng
            continue
        if not isinstance(rng, dict):
            raise bad('must be a table like { min = 1, max = 64 }, or a sum like "past_seq + seq"')
        _check_keys(where, rng, _DIM_KEYS, context, "dims")
        lo = _int(where, rng.get("min", 1), f"{context}.min", name, "dims")
        hi = _int(where, rng.get("max"), f"{context}.max", name, "dims")
        if lo < 0:
            raise bad(f"min must be at least 0, got {lo}")
        if lo > hi:
            raise bad(f"min {lo} is greater than max {hi}")
        if lo == hi:
            raise bad(f"min and max are both {lo}: a dim of one size is static; write {lo} in the shapes instead")
        if hi < 2:
            raise bad("max must be at least 2 for the axis to be dynamic")
        if hi > MAX_DIM:
            raise bad(f"max {hi} is above the limit {MAX_DIM}")
        dims[name] = DimRange(lo, hi)
    for name, text in sums.items():
        parts = tuple(p.strip() for p in text.split("+"))
        unknown = [p for p in parts if p not in dims or p in sums]  # a sum of a sum is not declared {min, max}
        if len(parts) < 2 or unknown or len(set(parts)) != len(parts):
            declared = ", ".join(d for d in dims if d not in sums) or "none"
            verb = "is not one" if len(unknown) == 1 else "are not"
            which = f": {', '.join(repr(p) for p in unknown)} {verb} (declared: {declared})" if unknown else ""
            raise where.error(
                f"dim '{name}': a sum must add two or more distinct dims declared with {{min, max}}, "
                f'like "past_seq + seq"; got {text!r}{which}',
                name,
                "dims",
            )
        dims[name] = DimRange(sum(dims[p].min for p in parts), sum(dims[p].max for p in parts), parts)
    return dims


def _check_dim_use(
    where: _Where, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...], dims: dict[str, DimRange]
) -> None:
    names = [t.name for t in inputs + outputs]
    for n in names:
        if names.count(n) > 1:
            raise where.error(f"tensor name '{n}' is used twice among inputs and outputs")
    used = {d for t in inputs + outputs for d in t.shape if isinstance(d, str)}
    for t in inputs + outputs:
        for d in t.shape:
            if isinstance(d, str) and d not in dims:
                raise where.error(f"'{t.name}' uses dim '{d}', which [dims] does not declare", "shape")
    for d in dims:
        if d not in used:
            raise where.error(f"dim '{d}' is declared but no input or output uses it", d, "dims")
    for i, t in enumerate(inputs):
        key = t.shape[-1] if t.mask is not None else None  # every layout ends in the key axis
        if isinstance(key, str) and dims[key].min == 0:
            raise where.error(
                f"mask '{t.name}': its key dim '{key}' has min = 0, and a query needs a key to attend to; "
                'a mask\'s keys are the cache and the new tokens (a sum dim like "past_seq + seq")',
                "shape",
                "inputs",
                i,
            )
    input_dims = {d for t in inputs for d in t.shape if isinstance(d, str)}
    for t in outputs:
        for d in t.shape:
            if isinstance(d, str) and d not in input_dims and not set(dims[d].parts or [d]) <= input_dims:
                raise where.error(f"output '{t.name}' uses dim '{d}', which no input has", "shape")


def _choice(where: _Where, raw: dict[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = raw.get(key, default)
    if value not in choices:
        raise where.error(f"{key} {value!r} is not one of {', '.join(choices)}", key)
    return str(value)


def _weights(where: _Where, raw: dict[str, Any], folder: Path | None) -> WeightsSpec:
    """Weights paths are resolved against the spec's folder and must exist; without a
    folder (a manifest's copy, which is data) the path is kept as recorded, unchecked."""
    table = _table(where, raw, "weights", "a table with 'seed' or 'path'")
    _check_keys(where, table, _WEIGHT_KEYS, "[weights]", "weights")
    seed = _int(where, table.get("seed", 0), "weights.seed", "seed", "weights")
    if not 0 <= seed < 2**63:  # what torch.manual_seed takes as a seed
        raise where.error(f"weights.seed must be 0 to 2**63 - 1, got {seed}", "seed", "weights")
    wpath = table.get("path")
    if wpath is None:
        return WeightsSpec(seed)
    if not isinstance(wpath, str) or not wpath:
        raise where.error("weights.path must be a non-empty string", "path", "weights")
    if folder is None:
        return WeightsSpec(seed, wpath)
    resolved = folder / wpath
    if not resolved.is_file():
        what = "is not a file" if resolved.exists() else "does not exist"
        raise where.error(f"weights file {wpath} {what}", "path", "weights")
    return WeightsSpec(seed, str(resolved.resolve()))


def _variant_table(where: _Where, variant: str) -> str:
    """The ``[variants.<name>]`` table of a variant other than ``auto``, or of a chain, as
    TOML writes its header (``variants."ort-past+int8"``: ``+`` needs quotes)."""
    table = Chain(variant, ()).table
    if CHAIN not in variant and variant not in _TOLERANCE_VARIANTS:
        known = ", ".join(_TOLERANCE_VARIANTS)
        raise where.error(f"unknown variant '{variant}' (known: {known})", variant, table)
    try:
        variant_chain(variant)
    except UsageError as e:
        raise where.error(str(e), variant, table) from e
    return table


def _tolerances(
    where: _Where, raw: dict[str, Any], outputs: tuple[TensorSpec, ...]
) -> tuple[Tolerance, dict[str, Tolerance], dict[str, Tolerance]]:
    table = _table(where, raw, "tolerance", "a table with atol and rtol")
    _check_keys(where, table, _TOL_KEYS, "[tolerance]", "tolerance")
    tolerance = Tolerance(
        _number(where, table.get("atol", 1e-5), "tolerance.atol", "atol", "tolerance"),
        _number(where, table.get("rtol", 1e-4), "tolerance.rtol", "rtol", "tolerance"),
        _bool(where, table.get("allow_nan", False), "tolerance.allow_nan", "allow_nan", "tolerance"),
        _number(where, table.get("atol_rms", 0.0), "tolerance.atol_rms", "atol_rms", "tolerance"),
        _number(where, table.get("rms_rtol", 0.0), "tolerance.rms_rtol", "rms_rtol", "tolerance"),
    )
    per_output: dict[str, Tolerance] = {}
    raw_per_output = table.get("outputs", {})
    if not isinstance(raw_per_output, dict):
        raise where.error("'tolerance.outputs' must be a table of per-output tolerances", "outputs", "tolerance")
    for name, tol in raw_per_output.items():
        if name not in {t.name for t in outputs}:
            known = ", ".join(t.name for t in outputs)
            raise where.error(
                f"tolerance for unknown output '{name}' (outputs: {known})", name, f"tolerance.outputs.{name}"
            )
        per_output[name] = _tolerance_table(where, tol, tolerance, f"tolerance.outputs.{name}", name)
    per_variant: dict[str, Tolerance] = {}
    for variant, tol in _table(where, raw, "variants", "a table of per-variant tolerances").items():
        context = _variant_table(where, variant)
        # a key left out keeps the variant's own default (int8's rms shares), else the model's
        own = VARIANTS[variant].tolerance if variant in VARIANTS else None
        default = tolerance if own is None else dataclasses.replace(own, allow_nan=tolerance.allow_nan)
        rounded = [
            link.tolerance for link in variant_chain(variant).links if link.tolerance and link.tolerance.int8_rounding
        ]
        if rounded:  # a chain rounds as its quantizing link
            default = dataclasses.replace(default, int8_rounding=True, weight_bits=rounded[-1].weight_bits)
        per_variant[variant] = _tolerance_table(where, tol, default, context, variant)
    return tolerance, per_output, per_variant


def _typical(where: _Where, raw: dict[str, Any], dims: dict[str, DimRange]) -> dict[str, int]:
    typical = {k: min(r.max, max(r.min, 64)) for k, r in dims.items()}
    for name, size in _table(where, raw, "typical", "a table of dim sizes").items():
        if name not in dims:
            raise where.error(f"typical size for undeclared dim '{name}'", name, "typical")
        size = _int(where, size, f"typical.{name}", name, "typical")
        if not dims[name].min <= size <= dims[name].max:
            span = f"{dims[name].min}..{dims[name].max}"
            raise where.error(f"typical.{name} = {size} is outside its range {span}", name, "typical")
        typical[name] = size
    return typical


def _flag(where: _Where, raw: dict[str, Any], key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise where.error(f"'{key}' must be true or false, got {value!r}", key)
    return value


def _max_memory(where: _Where, raw: dict[str, Any]) -> int | None:
    value = raw.get("max_memory")
    if value is None:
        return None
    try:
        return parse_bytes(str(value), "max_memory")
    except UsageError as e:
        raise where.error(str(e), "max_memory") from e


def _cache_size(where: _Where, raw: dict[str, Any], key: str) -> int | None:
    """One ``[cache]`` size, at least 1 (checked against the cache's dims by ``cache_of``):
    ``max_seq``, the positions a buffer updated in place holds; ``window``, the newest
    positions a sliding-window cache keeps; ``extend_batch``, the largest batch at which a
    step brings several new tokens to a filled cache."""
    table = _table(where, raw, "cache", "a table like { window = 4096 }")
    _check_keys(where, table, {"max_seq", "window", "extend_batch"}, "[cache]", "cache")
    if key not in table:
        return None
    size = _int(where, table[key], f"cache.{key}", key, "cache")
    if size < 1:
        raise where.error(f"cache.{key} = {size} must be at least 1", key, "cache")
    return size


def _guards(where: _Where, raw: dict[str, Any], dims: dict[str, DimRange]) -> tuple[Guard, ...]:
    """A built spec's accepted guards (``Guard.to_dict``): each point sizes every free dim
    inside its declared range."""
    value = raw.get("guards", [])
    if not isinstance(value, list) or not all(isinstance(g, dict) for g in value):
        raise where.error("'guards' must be a list of tables", "guards")
    free = {k: r for k, r in dims.items() if not r.parts}
    guards = []
    for g in value:
        _check_keys(where, g, {"condition", "where", "points"}, "a guard", "guards")
        condition, at, points = g.get("condition"), g.get("where", ""), g.get("points", [])
        if not isinstance(condition, str) or not isinstance(at, str) or not isinstance(points, list):
            raise where.error("a guard needs a condition and where (strings) and points (a list)", "guards")
        for point in points:
            if not isinstance(point, dict) or set(point) != set(free):
                raise where.error(f"guard '{condition}': a point must size the dims {', '.join(free)}", "guards")
            for k, v in point.items():
                if not free[k].min <= _int(where, v, f"guard '{condition}': {k}", "guards") <= free[k].max:
                    raise where.error(f"guard '{condition}': {k}={v} is outside its declared range", "guards")
        guards.append(Guard(condition, at, tuple(dict(p) for p in points)))
    return tuple(guards)


def _vocab(where: _Where, raw: dict[str, Any], inputs: tuple[TensorSpec, ...]) -> dict[str, tuple[int, int]]:
    """A built spec's values per integer input that reach its tables (``ModelSpec.vocab``):
    ``[least, greatest]``, or a row count from builds that knew only embeddings."""
    value = raw.get("vocab", {})
    bits = {t.name: int(t.dtype.removeprefix("int")) for t in inputs if t.is_ids and t.values is None}
    ranges = {k: [0, v - 1] if _is_int(v) else v for k, v in value.items()} if isinstance(value, dict) else None
    if ranges is None or not all(
        k in bits
        and isinstance(v, list)
        and len(v) == 2
        and all(map(_is_int, v))
        and -(2 ** (bits[k] - 1)) <= v[0] <= v[1] < 2 ** (bits[k] - 1)
        for k, v in ranges.items()
    ):
        raise where.error(
            "'vocab' must map integer inputs to the [least, greatest] value reaching their tables", "vocab"
        )
    return {k: (v[0], v[1]) for k, v in ranges.items()}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _description(where: _Where, raw: dict[str, Any]) -> str:
    value = raw.get("description", "")
    if not isinstance(value, str):
        raise where.error("'description' must be a string", "description")
    return value


def _config(where: _Where, raw: dict[str, Any]) -> dict[str, Any] | None:
    """``config = { class = "package.module:Config", ... }``: built first, passed as ``config=``."""
    if "config" not in raw:
        return None
    table = _table(where, raw, "config", 'a table like { class = "transformers:BertConfig", hidden_size = 64 }')
    cls = table.get("class")
    if not isinstance(cls, str) or not _OBJECT.fullmatch(cls):
        raise where.error(f"config needs class = 'package.module:Class', got {cls!r}", "class", "config")
    return dict(table)


def _call(where: _Where, raw: dict[str, Any], inputs: tuple[TensorSpec, ...]) -> dict[str, Any]:
    """Extra forward() keywords: plain values, ``{ positions_of = "<input>" }`` (position ids
    from that input's [batch, seq]) or ``{ rotary = "package.module:Class", positions_of =
    "<input>" }`` (the module built from the spec's config, called with the input and its
    position ids)."""
    table = _table(where, raw, "call", "a table of forward() keywords")
    names = {t.name for t in inputs}
    taken = {t.arg for t in inputs if t.arg}
    for key, value in table.items():
        if not _NAME.fullmatch(key) or key in taken:
            raise where.error(f"call.{key}: not a keyword name, or an input is already passed as it", key, "call")
        if not isinstance(value, dict):
            continue
        _check_keys(where, value, {"positions_of", "rotary"}, f"call.{key}", "call")
        if value.get("positions_of") not in names:
            raise where.error(f"call.{key}: positions_of must name an input ({', '.join(sorted(names))})", key, "call")
        rotary = value.get("rotary")
        if rotary is not None and not (isinstance(rotary, str) and _OBJECT.fullmatch(rotary)):
            raise where.error(f"call.{key}: rotary must look like 'package.module:Class'", key, "call")
    return dict(table)


def spec_from_dict(
    raw: dict[str, Any], *, path: Path | None = None, text: str = "", folder: Path | None = None
) -> ModelSpec:
    """Validate a parsed spec; every problem is a SpecError naming the file and key.

    ``path`` is the spec file (its folder becomes the search path); ``folder`` gives a
    copy made by ``ModelSpec.to_dict`` its folder back. Without either, the spec is data
    (a manifest's copy): nothing it names is resolved, checked or importable."""
    where = _Where(path, text)
    folder = path.parent.resolve() if path is not None else folder
    # A copy made by to_dict (no path) also carries its name and what its export accepted.
    _check_keys(where, raw, _TOP_KEYS | ({"name", "guards", "vocab"} if path is None else set()), "the spec", None)
    name = raw.get("name", path.stem if path else None)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise where.error(f"model name {name!r} must be letters, digits, '_', '-' or '.'", "name")
    suffix = name.rpartition(".")[2]
    if "." in name and suffix in VARIANTS:
        # model 'mha' built with --variant int8 is 'mha.int8' too: one would silently replace the other
        raise where.error(f"model name {name!r} ends in the variant name '.{suffix}'; rename the spec", "name")
    module = raw.get("module")
    if not isinstance(module, str) or not _OBJECT.fullmatch(module):
        raise where.error(f"'module' must look like 'package.module:Class', got {module!r}", "module")
    kwargs = _table(where, raw, "kwargs", "a table")
    inputs, outputs = _tensors(where, raw, "inputs"), _tensors(where, raw, "outputs")
    dims = _dims(where, raw)
    _check_dim_use(where, inputs, outputs, dims)
    opset = _int(where, raw.get("opset", 18), "opset", "opset")
    if not 7 <= opset <= 30:
        raise where.error(f"opset {opset} is outside 7..30", "opset")
    tolerance, per_output, per_variant = _tolerances(where, raw, outputs)
    spec = ModelSpec(
        name=name,
        module=module,
        inputs=inputs,
        outputs=outputs,
        dims=dims,
        kwargs=dict(kwargs),
        opset=opset,
        exporter=_choice(where, raw, "exporter", "dynamo", EXPORTERS),
        mode=_choice(where, raw, "mode", "eval", MODES),
        weights=_weights(where, raw, folder),
        tolerance=tolerance,
        output_tolerances=per_output,
        variant_tolerances=per_variant,
        typical=_typical(where, raw, dims),
        description=_description(where, raw),
        accept_guards=_flag(where, raw, "accept_guards"),
        search_path=str(folder) if folder is not None else None,
        max_memory=_max_memory(where, raw),
        config=_config(where, raw),
        call=_call(where, raw, inputs),
        fully_masked=_choice(where, raw, "fully_masked", "match", FULLY_MASKED),
        cache_max_seq=_cache_size(where, raw, "max_seq"),
        cache_window=_cache_size(where, raw, "window"),
        cache_extend_batch=_cache_size(where, raw, "extend_batch"),
        guards=_guards(where, raw, dims),
        vocab=_vocab(where, raw, inputs),
    )
    expanded = [t.name for t in inputs if t.expand]
    if expanded and spec.config is None:
        raise where.error(
            f"input '{expanded[0]}': expand builds the mask as the model class does, from the spec's config; "
            'add config = { class = "transformers:...Config", ... }',
            "expand",
        )
    try:
        cache_of(spec)
    except SpecError as e:
        raise where.error(str(e).removeprefix(f"{name}: ")) from e
    return spec


def load_spec(path: Path) -> ModelSpec:
    """Read and validate one TOML spec file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise SpecError(f"{path}: no such spec file") from e
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: cannot read spec: {e}") from e
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: invalid TOML: {e}") from e
    if "name" in raw:
        raise _Where(path, text).error("unknown key 'name' in the spec (the model's name is the file's name)", "name")
    return spec_from_dict(raw, path=path, text=text)


def spec_paths(models_dir: Path, names: tuple[str, ...] = ()) -> list[Path]:
    """The spec files of a model folder (sorted), or the named ones: a name is a model in
    the folder or the path of a ``.toml`` spec file anywhere."""
    files = {n: Path(n) for n in names if n.endswith(".toml")}
    for path in files.values():
        if not path.is_file():
            raise SpecError(f"{path}: no such spec file")
    if names and len(files) == len(names):
        return [files[n] for n in dict.fromkeys(names)]
    if not models_dir.is_dir():
        raise SpecError(f"{models_dir}: no such model directory (pass --models DIR)")
    paths = sorted(models_dir.glob("*.toml"))
    if not paths:
        raise SpecError(f"{models_dir}: no *.toml model specs found")
    if not names:
        return paths
    by_name = {p.stem: p for p in paths}
    unknown = [n for n in names if n not in by_name and n not in files]
    if unknown:
        raise SpecError(
            f"unknown model {', '.join(repr(n) for n in unknown)} (known: {', '.join(sorted(by_name))}; "
            "or give a spec file's path)"
        )
    return [files[n] if n in files else by_name[n] for n in dict.fromkeys(names)]
