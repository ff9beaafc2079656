"""Model specs: one declarative TOML file per model, validated into frozen dataclasses.

A spec is the single source of truth for a model: what to build, how to feed it, and how
strictly to judge it. Everything downstream (export, manifest, verify) reads these classes.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attn_export.errors import SpecError

__all__ = [
    "DTYPES",
    "MASK_KINDS",
    "DimRange",
    "ModelSpec",
    "TensorSpec",
    "Tolerance",
    "WeightsSpec",
    "load_spec",
    "spec_paths",
    "spec_from_dict",
]

DTYPES = ("float32", "float16", "float64", "int32", "int64", "bool")
MASK_KINDS = ("random", "padding", "causal")
EXPORTERS = ("dynamo", "torchscript")
#: Graph variants a spec may give tolerances for (see ``attn_export.variants``).
VARIANT_NAMES = ("fp32", "attention-op", "ort-fused", "int8", "fp16", "ort-optimized")
MODES = ("eval", "train")
#: Refused before allocating: sizes above this would not fit any machine we verify on.
MAX_DIM = 1 << 20

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
}
_TENSOR_KEYS = {"name", "dtype", "shape", "mask"}
_DIM_KEYS = {"min", "max"}
_WEIGHT_KEYS = {"seed", "path"}
_TOL_KEYS = {"atol", "rtol", "outputs"}


@dataclass(frozen=True)
class DimRange:
    """The sizes a symbolic dimension may take, inclusive."""

    min: int
    max: int


@dataclass(frozen=True)
class TensorSpec:
    """A named input or output: dtype and shape, where a string is a symbolic dim."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    #: For boolean mask inputs: how verification fills them ("random", "padding", "causal").
    mask: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.mask is not None:
            d["mask"] = self.mask
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d.get("mask"))


@dataclass(frozen=True)
class Tolerance:
    """Pass rule |actual - expected| <= atol + rtol * |expected|."""

    atol: float
    rtol: float


#: Used when a spec gives no [variants.<name>] tolerance; int8 and fp16 trade accuracy for speed.
VARIANT_DEFAULT_TOLERANCES = {"int8": Tolerance(0.1, 0.1), "fp16": Tolerance(1e-2, 1e-2)}


@dataclass(frozen=True)
class WeightsSpec:
    """Where the weights come from: a seeded random init, or a state_dict file."""

    seed: int = 0
    #: Absolute path of a state_dict saved with torch.save; None means seeded init.
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
    #: Directory searched first when importing ``module`` (the spec file's folder).
    search_path: str | None = None

    def tolerance_for(self, output: str, variant: str = "fp32") -> Tolerance:
        """A variant's own tolerance (spec, else the variant's default), else the output's."""
        if variant in self.variant_tolerances:
            return self.variant_tolerances[variant]
        if variant in VARIANT_DEFAULT_TOLERANCES:
            return VARIANT_DEFAULT_TOLERANCES[variant]
        return self.output_tolerances.get(output, self.tolerance)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form; ``spec_from_dict`` reads it back."""
        return {
            "name": self.name,
            "description": self.description,
            "module": self.module,
            "kwargs": self.kwargs,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "dims": {k: asdict(v) for k, v in self.dims.items()},
            "opset": self.opset,
            "exporter": self.exporter,
            "mode": self.mode,
            "weights": asdict(self.weights),
            "tolerance": {
                "atol": self.tolerance.atol,
                "rtol": self.tolerance.rtol,
                "outputs": {k: asdict(v) for k, v in self.output_tolerances.items()},
            },
            "variants": {k: asdict(v) for k, v in self.variant_tolerances.items()},
            "typical": dict(self.typical),
            "search_path": self.search_path,
        }

    def content_hash(self) -> str:
        """sha256 of what determines the exported graph (not where the spec lives)."""
        d = self.to_dict()
        d.pop("search_path")
        d.pop("description")
        d["weights"] = dict(d["weights"])
        if self.weights.path is not None:
            d["weights"]["path"] = _file_sha256(Path(self.weights.path))
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def _file_sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise SpecError(f"cannot read weights file {path}: {e.strerror}") from e


class _Where:
    """Builds error messages that name the spec file and, when found, the line of a key."""

    def __init__(self, path: Path | None, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

    def error(self, message: str, key: str | None = None) -> SpecError:
        where = str(self.path) if self.path else "<spec>"
        if key is not None:
            pattern = re.compile(rf"^\s*(\"{re.escape(key)}\"|{re.escape(key)})\s*=")
            for i, line in enumerate(self.lines, 1):
                if pattern.match(line):
                    where += f":{i}"
                    break
        return SpecError(f"{where}: {message}")


def _check_keys(where: _Where, table: dict[str, Any], allowed: set[str], context: str) -> None:
    for key in table:
        if key not in allowed:
            raise where.error(
                f"unknown key '{key}' in {context} (expected one of: {', '.join(sorted(allowed))})",
                key,
            )


def _int(where: _Where, value: Any, what: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.error(f"{what} must be an integer, got {value!r}", key)
    return value


def _number(where: _Where, value: Any, what: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise where.error(f"{what} must be a non-negative number, got {value!r}", key)
    return float(value)


def _tolerance_table(where: _Where, raw: Any, default: Tolerance, context: str, key: str) -> Tolerance:
    """An {atol, rtol} table; a missing value falls back to ``default``."""
    if not isinstance(raw, dict):
        raise where.error(f"{context} must be a table with atol and rtol", key)
    _check_keys(where, raw, {"atol", "rtol"}, context)
    return Tolerance(
        _number(where, raw.get("atol", default.atol), f"{context}.atol", "atol"),
        _number(where, raw.get("rtol", default.rtol), f"{context}.rtol", "rtol"),
    )


def _tensor(where: _Where, raw: Any, context: str, is_input: bool) -> TensorSpec:
    if not isinstance(raw, dict):
        raise where.error(f"{context} must be a table with name, dtype and shape")
    _check_keys(where, raw, _TENSOR_KEYS if is_input else _TENSOR_KEYS - {"mask"}, context)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise where.error(f"{context} needs a non-empty string 'name'", "name")
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        raise where.error(f"{context} '{name}': dtype {dtype!r} is not one of {', '.join(DTYPES)}", "dtype")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not shape:
        raise where.error(f"{context} '{name}': 'shape' must be a non-empty list", "shape")
    for dim in shape:
        ok_static = isinstance(dim, int) and not isinstance(dim, bool) and 0 < dim <= MAX_DIM
        ok_symbolic = isinstance(dim, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", dim)
        if not (ok_static or ok_symbolic):
            raise where.error(f"{context} '{name}': dim {dim!r} must be a positive integer or a dim name", "shape")
    mask = raw.get("mask")
    if mask is not None:
        if mask not in MASK_KINDS:
            raise where.error(f"input '{name}': mask {mask!r} is not one of {', '.join(MASK_KINDS)}", "mask")
        if dtype != "bool":
            raise where.error(f"input '{name}': a mask must have dtype bool, not {dtype}", "dtype")
        if len(shape) < 2:
            raise where.error(f"input '{name}': a mask needs at least [seq, kv_seq] dims", "shape")
    return TensorSpec(name, dtype, tuple(shape), mask)


def spec_from_dict(raw: dict[str, Any], *, path: Path | None = None, text: str = "") -> ModelSpec:
    """Validate a parsed spec; every problem is a SpecError naming the file and key."""
    where = _Where(path, text)
    # A manifest's copy of a spec (no path) also carries its name and search path.
    _check_keys(where, raw, _TOP_KEYS | ({"name", "search_path"} if path is None else set()), "the spec")
    name = raw.get("name", path.stem if path else None)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise where.error(f"model name {name!r} must be letters, digits, '_', '-' or '.'", "name")
    module = raw.get("module")
    if not isinstance(module, str) or not re.fullmatch(r"[\w.]+:[\w.]+", module):
        raise where.error(f"'module' must look like 'package.module:Class', got {module!r}", "module")
    kwargs = raw.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise where.error("'kwargs' must be a table", "kwargs")

    raw_inputs = raw.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise where.error("the spec needs at least one [[inputs]] entry", "inputs")
    inputs = tuple(_tensor(where, t, f"inputs[{i}]", True) for i, t in enumerate(raw_inputs))
    raw_outputs = raw.get("outputs")
    if not isinstance(raw_outputs, list) or not raw_outputs:
        raise where.error("the spec needs at least one [[outputs]] entry", "outputs")
    outputs = tuple(_tensor(where, t, f"outputs[{i}]", False) for i, t in enumerate(raw_outputs))
    names = [t.name for t in inputs + outputs]
    for n in names:
        if names.count(n) > 1:
            raise where.error(f"tensor name '{n}' is used twice among inputs and outputs")

    raw_dims = raw.get("dims", {})
    if not isinstance(raw_dims, dict):
        raise where.error("'dims' must be a table of {min, max} ranges", "dims")
    dims: dict[str, DimRange] = {}
    for dim_name, rng in raw_dims.items():
        if not isinstance(rng, dict):
            raise where.error(f"dim '{dim_name}' must be a table like {{ min = 1, max = 64 }}", dim_name)
        _check_keys(where, rng, _DIM_KEYS, f"dims.{dim_name}")
        lo = _int(where, rng.get("min", 1), f"dims.{dim_name}.min", dim_name)
        hi = _int(where, rng.get("max"), f"dims.{dim_name}.max", dim_name)
        if lo < 1:
            raise where.error(f"dim '{dim_name}': min must be at least 1, got {lo}", dim_name)
        if lo > hi:
            raise where.error(f"dim '{dim_name}': min {lo} is greater than max {hi}", dim_name)
        if hi < 2:
            raise where.error(f"dim '{dim_name}': max must be at least 2 for the axis to be dynamic", dim_name)
        if hi > MAX_DIM:
            raise where.error(f"dim '{dim_name}': max {hi} is above the limit {MAX_DIM}", dim_name)
        dims[dim_name] = DimRange(lo, hi)
    used = {d for t in inputs + outputs for d in t.shape if isinstance(d, str)}
    for t in inputs + outputs:
        for d in t.shape:
            if isinstance(d, str) and d not in dims:
                raise where.error(f"'{t.name}' uses dim '{d}', which [dims] does not declare", "shape")
    for d in dims:
        if d not in used:
            raise where.error(f"dim '{d}' is declared but no input or output uses it", d)
    input_dims = {d for t in inputs for d in t.shape if isinstance(d, str)}
    for t in outputs:
        for d in t.shape:
            if isinstance(d, str) and d not in input_dims:
                raise where.error(f"output '{t.name}' uses dim '{d}', which no input has", "shape")

    opset = _int(where, raw.get("opset", 18), "opset", "opset")
    if not 7 <= opset <= 30:
        raise where.error(f"opset {opset} is outside 7..30", "opset")
    exporter = raw.get("exporter", "dynamo")
    if exporter not in EXPORTERS:
        raise where.error(f"exporter {exporter!r} is not one of {', '.join(EXPORTERS)}", "exporter")
    mode = raw.get("mode", "eval")
    if mode not in MODES:
        raise where.error(f"mode {mode!r} is not one of {', '.join(MODES)}", "mode")

    raw_weights = raw.get("weights", {})
    if not isinstance(raw_weights, dict):
        raise where.error("'weights' must be a table with 'seed' or 'path'", "weights")
    _check_keys(where, raw_weights, _WEIGHT_KEYS, "[weights]")
    seed = _int(where, raw_weights.get("seed", 0), "weights.seed", "seed")
    wpath = raw_weights.get("path")
    if wpath is not None:
        if not isinstance(wpath, str):
            raise where.error("weights.path must be a string", "path")
        resolved = Path(wpath) if Path(wpath).is_absolute() or path is None else path.parent / wpath
        if not resolved.is_file():
            raise where.error(f"weights file {wpath} does not exist", "path")
        wpath = str(resolved.resolve())
    weights = WeightsSpec(seed, wpath)

    raw_tol = raw.get("tolerance", {})
    if not isinstance(raw_tol, dict):
        raise where.error("'tolerance' must be a table with atol and rtol", "tolerance")
    _check_keys(where, raw_tol, _TOL_KEYS, "[tolerance]")
    tolerance = Tolerance(
        _number(where, raw_tol.get("atol", 1e-5), "tolerance.atol", "atol"),
        _number(where, raw_tol.get("rtol", 1e-4), "tolerance.rtol", "rtol"),
    )
    per_output: dict[str, Tolerance] = {}
    raw_per_output = raw_tol.get("outputs", {})
    if not isinstance(raw_per_output, dict):
        raise where.error("'tolerance.outputs' must be a table of per-output tolerances", "outputs")
    for out_name, tol in raw_per_output.items():
        if out_name not in {t.name for t in outputs}:
            raise where.error(f"tolerance for unknown output '{out_name}'", out_name)
        per_output[out_name] = _tolerance_table(where, tol, tolerance, f"tolerance.outputs.{out_name}", out_name)

    raw_variants = raw.get("variants", {})
    if not isinstance(raw_variants, dict):
        raise where.error("'variants' must be a table of per-variant tolerances", "variants")
    variant_tolerances: dict[str, Tolerance] = {}
    for variant, tol in raw_variants.items():
        if variant not in VARIANT_NAMES:
            raise where.error(f"unknown variant '{variant}' (known: {', '.join(VARIANT_NAMES)})", variant)
        variant_tolerances[variant] = _tolerance_table(where, tol, tolerance, f"variants.{variant}", variant)
    raw_typical = raw.get("typical", {})
    if not isinstance(raw_typical, dict):
        raise where.error("'typical' must be a table of dim sizes", "typical")
    typical = {k: min(r.max, max(r.min, 64)) for k, r in dims.items()}
    for dim_name, size in raw_typical.items():
        if dim_name not in dims:
            raise where.error(f"typical size for undeclared dim '{dim_name}'", dim_name)
        size = _int(where, size, f"typical.{dim_name}", dim_name)
        if not dims[dim_name].min <= size <= dims[dim_name].max:
            raise where.error(f"typical.{dim_name} = {size} is outside its range", dim_name)
        typical[dim_name] = size

    description = raw.get("description", "")
    if not isinstance(description, str):
        raise where.error("'description' must be a string", "description")
    search_path = raw.get("search_path", str(path.parent.resolve()) if path else None)
    if search_path is not None and not isinstance(search_path, str):
        raise where.error("'search_path' must be a string", "search_path")
    return ModelSpec(
        name=name,
        module=module,
        inputs=inputs,
        outputs=outputs,
        dims=dims,
        kwargs=dict(kwargs),
        opset=opset,
        exporter=exporter,
        mode=mode,
        weights=weights,
        tolerance=tolerance,
        output_tolerances=per_output,
        variant_tolerances=variant_tolerances,
        typical=typical,
        description=description,
        search_path=search_path,
    )


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
    for key in ("name", "search_path"):
        if key in raw:
            raise _Where(path, text).error(
                f"unknown key '{key}' in the spec (the model's name is the file's name)", key
            )
    return spec_from_dict(raw, path=path, text=text)


def spec_paths(models_dir: Path, names: tuple[str, ...] = ()) -> list[Path]:
    """The spec files of a model folder (sorted), or just the named models'."""
    if not models_dir.is_dir():
        raise SpecError(f"{models_dir}: no such model directory (pass --models DIR)")
    paths = sorted(models_dir.glob("*.toml"))
    if not paths:
        raise SpecError(f"{models_dir}: no *.toml model specs found")
    if not names:
        return paths
    by_name = {p.stem: p for p in paths}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SpecError(f"unknown model {', '.join(repr(n) for n in unknown)} (known: {', '.join(sorted(by_name))})")
    return [by_name[n] for n in dict.fromkeys(names)]
