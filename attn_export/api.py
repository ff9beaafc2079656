"""The Python API: the commands as functions that return their result objects, and two for
a module in hand, with no TOML file.

``build`` and ``verify`` report failures as data (``BuildSummary``, ``VerifyReport``), as
the commands do; ``export`` raises the first failing check; ``assert_onnx_matches`` raises
AssertionError with the numbers of every failing case. Bad input is a UsageError; an
option out of its range, or two that cannot go together, is its subclass OptionError, whose
message names this API's parameters (``seed -1: a seed is 0 or more``), never a CLI flag.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from attn_export.artifacts.onnx_file import load_model_file
from attn_export.checks.spec_learning import learn_ranges, learned_spec
from attn_export.errors import OptionError, UsageError, notify
from attn_export.executors import Parallelism
from attn_export.exporter.factory import adapt
from attn_export.exporter.graph_checks import graph_shapes
from attn_export.exporter.torch_export import refuse_misfit
from attn_export.model_spec import ModelSpec, spec_from_dict, spec_paths
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.memory import parse_bytes
from attn_export.model_spec.shapes import example_sizes, format_sizes
from attn_export.pipelines.building import BuildOptions, BuildResult, BuildSummary, build_models, export_module
from attn_export.pipelines.verify import VerifyOptions, VerifyReport, select_models, verify_artifacts, verify_module
from attn_export.runtimes import resolve_targets
from attn_export.runtimes.base import RUN_TIMEOUT_S
from attn_export.runtimes.target import DEFAULT_RUNTIME

__all__ = ["assert_onnx_matches", "build", "export", "verify"]

Shape = Sequence[int | str]
#: An input as a shape, or as a table like a spec's [[inputs]] entry (dtype, mask, ...).
InputSpec = Shape | Mapping[str, Any]
#: A dim's range as (min, max) or {"min": .., "max": ..}.
#: (min, max), {"min": .., "max": ..}, or a sum of other dims: "past_seq + seq".
DimSpec = tuple[int, int] | Mapping[str, int] | str


def build(
    specs: str | Path | Sequence[str | Path] = "models",
    out: str | Path = "build",
    *,
    variants: Sequence[str] = ("fp32",),
    force: bool = False,
    opset: int | None = None,
    exporter: str | None = None,
    provider: str = "cpu",
    max_memory: int | str | None = None,
) -> BuildSummary:
    """Build spec files, or every spec of a folder, into ``out``: ``attn-export build``.
    ``max_memory`` (bytes, or a size such as ``"8GiB"``) is ``--max-memory``."""
    items = _paths("specs", specs)
    folders = [p for p in items if p.is_dir()]
    paths = [p for folder in folders for p in spec_paths(folder)]
    paths += spec_paths(Path("."), tuple(str(p) for p in items if not p.is_dir()))
    _typed("opset", opset, (int, type(None)), "an integer")
    options = BuildOptions(
        _path("out", out),
        opset,
        exporter,
        force,
        variants=_names("variants", variants),
        provider=_typed("provider", provider, (str,), "a provider's name"),
        max_memory=_bytes(max_memory),
    )
    with _called(out_dir="out"):
        return build_models(paths, options)


def verify(
    artifacts: str | Path | Sequence[str | Path] = "build",
    *,
    models: str | Path | None = None,
    golden: bool = False,
    shapes: Sequence[Mapping[str, int]] | None = None,
    seed: int = 0,
    n_random: int = 2,
    atol: float | None = None,
    rtol: float | None = None,
    providers: Sequence[str] = ("cpu",),
    runtimes: Sequence[str] = (DEFAULT_RUNTIME,),
    latency: bool = False,
    max_memory: int | str | None = None,
    jobs: int | None = None,
    executor: str = "local",
    spec: str | Path | None = None,
    variant: str = "fp32",
    regions: str | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
) -> VerifyReport:
    """Verify a build folder, or .onnx files from one: ``attn-export verify`` (timing is
    off unless ``latency``). PyTorch originals are rebuilt from the specs in ``models``;
    ``max_memory`` (bytes, or a size such as ``"8GiB"``) is ``--max-memory``; ``jobs`` and
    ``executor`` are ``--jobs`` and ``--executor`` (a script that starts processes guards its
    own work with ``if __name__ == "__main__":``). With ``spec`` (a spec file), ``artifacts``
    is one .onnx file no build made, judged as a graph of ``variant``: ``--spec``, ``--variant``.
    ``models`` defaults to ``"models"``; named with ``golden``, each graph's recorded spec must
    be the one there. ``regions="check"`` localizes one case of each graph that passes and
    notes, in its check's ``notes``, a region whose own error breaks its tolerance though the
    outputs agree; ``"strict"`` fails the graph on it: ``--check-regions``,
    ``--strict-regions``. A graph localize cannot take is left as judged, with a ``Notice``
    warning. ``timeout_s`` (``--region-timeout``) stops a run on ONNX Runtime after that many
    seconds: each case's of a graph holding a Loop, and with ``regions`` a region's."""
    paths = _paths("artifacts", artifacts)
    spec_file = None if spec is None else _path("spec", spec)
    _typed("variant", variant, (str,), "a variant's name")
    _typed("jobs", jobs, (int, type(None)), "a number of jobs")
    options = VerifyOptions(
        targets=resolve_targets(_names("runtimes", runtimes), _names("providers", providers)),
        models_dir=_path("models", models or "models"),
        golden=golden,
        golden_checkout=golden and models is not None,
        shapes=None if shapes is None else _shapes(shapes),
        **_sweep(seed, n_random, atol, rtol),
        latency=latency,
        max_memory=_bytes(max_memory),
        spec_file=spec_file,
        variant=variant,
        regions=_typed("regions", regions, (str, type(None)), '"check", "strict" or None'),
        region_timeout_s=timeout_s,
    )
    with _called(spec_file="spec", models_dir="models", region_timeout_s="timeout_s"):
        out_dir, manifest, names = select_models(paths, spec_file, variant)
        return verify_artifacts(
            out_dir, manifest, names, options, on_notice=notify, parallelism=Parallelism(executor, jobs)
        )


@contextmanager
def _called(**names: str) -> Iterator[None]:
    """An OptionError about options this API calls otherwise (``spec`` for ``spec_file``),
    in the API's words."""
    try:
        yield
    except OptionError as e:
        raise e.called(names) from e


def _typed(what: str, value: Any, kinds: tuple[type, ...], expected: str) -> Any:
    """``value``, unless it is none of ``kinds`` (a bool counts as no number): an argument of
    the wrong type reached code that assumed its type, and was a raw TypeError there."""
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise UsageError(f"{what}: give {expected}, not {value!r}")
    return value


def _list(what: str, value: Any, expected: str) -> Sequence[Any]:
    """``value`` if it is a list or a tuple (a string is no list of its letters)."""
    return _typed(what, value, (list, tuple), expected)


def _path(what: str, value: Any) -> Path:
    return Path(_typed(what, value, (str, os.PathLike), "a path"))


def _paths(what: str, value: Any) -> list[Path]:
    """One path, or a sequence of them."""
    if isinstance(value, str | os.PathLike):
        return [Path(value)]
    return [_path(f"{what}[{i}]", v) for i, v in enumerate(_list(what, value, "a path or a list of paths"))]


def _names(what: str, value: Any) -> tuple[str, ...]:
    """One name, or a sequence of them (a string is one name, not its letters)."""
    if isinstance(value, str):
        return (value,)
    names = _list(what, value, "a name or a list of names")
    return tuple(_typed(f"{what}[{i}]", v, (str,), "a name") for i, v in enumerate(names))


def _table(what: str, value: Any, of: str) -> Mapping[str, Any]:
    return _typed(what, value, (Mapping,), f"a mapping of each name to {of}")


def _shapes(shapes: Any) -> list[dict[str, int]]:
    """Each shape a mapping of dim to size."""
    shapes = _list("shapes", shapes, "a list of mappings of dim to size")
    return [
        {k: _typed(f"shapes[{i}][{k!r}]", v, (int,), "a size") for k, v in _table(f"shapes[{i}]", s, "a size").items()}
        for i, s in enumerate(shapes)
    ]


def _sweep(seed: Any, n_random: Any, atol: Any, rtol: Any) -> dict[str, Any]:
    """verify's sweep arguments, each of its type (their ranges are the options' to check)."""
    tolerance = (int, float, type(None))
    return {
        "seed": _typed("seed", seed, (int,), "an integer"),
        "n_random": _typed("n_random", n_random, (int,), "an integer"),
        "atol": _typed("atol", atol, tolerance, "a number"),
        "rtol": _typed("rtol", rtol, tolerance, "a number"),
    }


def _bytes(size: int | str | None) -> int | None:
    """A memory budget given as bytes or as a size string (``"512MiB"``), as the CLI takes it."""
    _typed("max_memory", size, (int, str, type(None)), 'bytes or a size such as "8GiB"')
    return parse_bytes(size, "max_memory") if isinstance(size, str) else size


def _name(module: Any, name: str | None) -> str:
    return name or re.sub(r"(?<!^)(?=[A-Z])", "_", type(module).__name__).lower()


def _dims(dims: Mapping[str, DimSpec]) -> dict[str, dict[str, int] | str]:
    out: dict[str, dict[str, int] | str] = {}
    for k, v in _table("dims", dims, "its range").items():
        if isinstance(v, str):
            out[k] = v
            continue
        pair = [v.get("min"), v.get("max")] if isinstance(v, Mapping) else v
        if not isinstance(pair, list | tuple) or len(pair) != 2 or None in pair:
            raise UsageError(
                f"dims[{k!r}]: give (min, max), {{'min': .., 'max': ..}} or a sum such as 'past_seq + seq', not {v!r}"
            )
        out[k] = {"min": pair[0], "max": pair[1]}
    return out


def _tensors(what: str, tensors: Mapping[str, InputSpec]) -> list[dict[str, Any]]:
    """Each tensor's spec entry, from its shape or its table."""
    out = []
    for n, t in _table(what, tensors, "its shape or table").items():
        if not isinstance(t, Mapping | list | tuple):
            raise UsageError(f"{what}[{n!r}]: give a shape (sizes and dim names) or a table, not {t!r}")
        out.append({"name": n, **(dict(t) if isinstance(t, Mapping) else {"shape": list(t)})})
    if not out:
        raise UsageError(f"{what}: give at least one")
    return out


def _module(module: Any) -> Any:
    import torch

    return _typed("module", module, (torch.nn.Module,), "a torch.nn.Module")


def _object_name(value: Any) -> Any:
    """A class given in ``call`` (a rotary module) as the ``package.module:Class`` a spec names."""
    return f"{value.__module__}:{value.__qualname__}" if isinstance(value, type) else value


def _call_table(call: Mapping[str, Any] | None) -> dict[str, Any]:
    """``call`` as a spec's [call] table: rotary classes named as a spec names them."""
    if not call:
        return {}
    _table("call", call, "its value")
    return {
        "call": {
            k: {kk: _object_name(vv) for kk, vv in v.items()} if isinstance(v, Mapping) else v for k, v in call.items()
        }
    }


def _config(module: Any, config: Any) -> Any:
    """The config rotary modules are built from: the one given, else the module's own
    (Hugging Face layers keep theirs as ``module.config``)."""
    return config if config is not None else getattr(module, "config", None)


def _spec(module: Any, raw: dict[str, Any]) -> ModelSpec:
    cls = type(module)
    raw = {"module": f"{cls.__module__}:{cls.__qualname__}", **raw}
    return spec_from_dict(raw)


def _adapted(module: Any, spec: ModelSpec, config: Any) -> tuple[Any, ModelSpec]:
    """The module as the pipelines call it, and ``spec`` with the values its ids take to
    land on the rows of the tables they index (as build learns them): drawn from 0..7, a
    graph that clamps a table passed."""
    adapted = adapt(module, spec, config)
    return adapted, learn_ranges(adapted, spec)


def _output_shapes(module: Any, raw: dict[str, Any], config: Any) -> list[dict[str, Any]]:
    """Outputs read off the module's result at two sets of sizes: an axis that follows a
    dim is named for it, one that stays is static. A None in a returned tuple (attention
    weights not asked for) is no output; the others are picked by their place."""
    probe = _spec(module, {**raw, "outputs": [{**raw["inputs"][0], "name": "_probe"}]})
    first = example_sizes(probe)
    second = {k: v + 1 if v < probe.dims[k].max else v - 1 for k, v in first.items()}
    adapted, probe = _adapted(module, probe, config)
    runs = []
    for sizes in (first, second):
        feeds = make_feeds(probe, sizes, 0)
        try:
            runs.append(_run(adapted, [feeds[t.name] for t in probe.inputs]))
        except UsageError:
            raise
        except Exception:
            refuse_misfit(adapted, probe, feeds)  # the inputs as given do not fit: one line, with the line
            raise
    (tensors, some_none), (others, _) = runs
    outputs = []
    for j, ((i, a), (_, b)) in enumerate(zip(tensors, others, strict=True)):
        shape: list[int | str] = []
        for axis, (sa, sb) in enumerate(zip(a.shape, b.shape, strict=True)):
            dim = next((k for k in first if (first[k], second[k]) == (sa, sb)), None)
            if sa == sb:
                shape.append(int(sa))
            elif dim is None:
                raise UsageError(f"output {i} axis {axis} follows no dim; pass outputs= with its shape")
            else:
                shape.append(dim)
        pick = {"pick": i} if some_none else {}
        outputs.append({"name": "output" if j == 0 else f"output_{j}", "shape": shape, **pick})
    return outputs


def _run(module: Any, arrays: list[np.ndarray]) -> tuple[list[tuple[int, Any]], bool]:
    """The module's tensors in order, each with its place in the result, and whether the
    result held a None."""
    import torch

    with torch.no_grad():
        result = module(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
    values = list(result) if isinstance(result, tuple | list) else [result]
    if not all(v is None or isinstance(v, torch.Tensor) for v in values) or all(v is None for v in values):
        raise UsageError("the module returns values that are not tensors; pass outputs= with a pick for each")
    return [(i, v) for i, v in enumerate(values) if v is not None], None in values


def export(
    module: Any,
    inputs: Mapping[str, InputSpec],
    dims: Mapping[str, DimSpec],
    *,
    outputs: Mapping[str, InputSpec] | None = None,
    path: str | Path = "model.onnx",
    name: str | None = None,
    opset: int = 18,
    exporter: str = "dynamo",
    atol: float = 1e-5,
    rtol: float = 1e-4,
    fully_masked: str = "match",
    call: Mapping[str, Any] | None = None,
    config: Any = None,
) -> BuildResult:
    """Export a module in hand with dynamic axes, check the graph, compare it with the
    module (shapes and named mask cases, as build does) and write it to ``path``.

    ``inputs`` maps each forward() input, in order, to its shape (strings are dims) or to a
    table like a spec's [[inputs]] entry; ``dims`` maps each dim to (min, max).
    ``outputs`` defaults to the module's outputs in order, their dims read off its result.
    ``call`` adds forward() keywords as a spec's [call] does; its rotary modules (a class or
    ``"package.module:Class"``) are built from ``config``, by default the module's own.
    Raises the first failing check (CheckFailed) or UsageError.
    """
    raw: dict[str, Any] = {
        "name": _name(_module(module), name),
        "inputs": _tensors("inputs", inputs),
        "dims": _dims(dims),
        "opset": opset,
        "exporter": exporter,
        "tolerance": {"atol": atol, "rtol": rtol},
        "fully_masked": fully_masked,
        **_call_table(call),
    }
    config = _config(module, config)
    raw["outputs"] = _tensors("outputs", outputs) if outputs else _output_shapes(module, raw, config)
    adapted, spec = _adapted(module, _spec(module, raw), config)
    return export_module(adapted, spec, _path("path", path))


_ELEM_TYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.BOOL: "bool",
}


def _graph_tensors(
    values: Sequence[Any], shapes: Mapping[str, Sequence[int | str | None]], overrides: Mapping[str, Any], kind: str
) -> list[dict[str, Any]]:
    """Graph inputs or outputs as a spec's [[inputs]]/[[outputs]] entries; an override for
    a name the graph lacks is refused (a graph that lost its mask input was judged against
    the module run without one, and passed)."""
    names = [v.name for v in values]
    for name, keys in _table(kind, overrides, "a table of keys to add").items():
        _typed(f"{kind}[{name!r}]", keys, (Mapping,), "a table of keys to add, as a spec's entry has")
    unknown = [name for name in overrides if name not in names]
    if unknown:
        raise UsageError(
            f"{kind}={{{unknown[0]!r}: ...}}: the graph has no {kind[:-1]} '{unknown[0]}' (its {kind}: "
            f"{', '.join(names) or 'none'})"
        )
    out = []
    for v in values:
        dtype = _ELEM_TYPES.get(v.type.tensor_type.elem_type)
        if dtype is None:
            raise UsageError(f"'{v.name}' has an element type attn-export does not feed")
        if None in shapes[v.name]:
            raise UsageError(f"'{v.name}' has an axis with neither a size nor a name in the graph")
        out.append({"name": v.name, "dtype": dtype, "shape": list(shapes[v.name]), **overrides.get(v.name, {})})
    return out


def assert_onnx_matches(
    module: Any,
    path: str | Path,
    dims: Mapping[str, DimSpec],
    *,
    inputs: Mapping[str, Mapping[str, Any]] | None = None,
    outputs: Mapping[str, Mapping[str, Any]] | None = None,
    call: Mapping[str, Any] | None = None,
    config: Any = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
    n_random: int = 2,
    fully_masked: str = "match",
) -> None:
    """Assert that the ONNX file at ``path`` gives ``module``'s numbers over verify's sweep,
    named mask cases included, by verify's pass rule.

    Inputs and outputs (names, dtypes, symbolic dims) are read from the graph; ``dims``
    gives each symbolic dim its range. ``inputs`` and ``outputs`` add keys to an entry, as
    in a spec (``{"mask": {"mask": "padding", "convention": "ignore"}}``, ``{"output":
    {"pick": 0}}``), and ``call`` adds forward() keywords, its rotary modules built from
    ``config`` (by default the module's own), as in ``export``.
    """
    file = _path("path", path)
    _module(module)
    proto = load_model_file(file)
    graph, shapes = proto.graph, graph_shapes(proto)
    weights = {i.name for i in graph.initializer}
    raw = {
        "name": _name(module, None),
        "inputs": _graph_tensors([i for i in graph.input if i.name not in weights], shapes, inputs or {}, "inputs"),
        "outputs": _graph_tensors(graph.output, shapes, outputs or {}, "outputs"),
        "dims": _dims(dims),
        "tolerance": {"atol": atol, "rtol": rtol},
        "fully_masked": fully_masked,
        **_call_table(call),
    }
    declared = _spec(module, raw)
    adapted = adapt(module, declared, _config(module, config))
    spec = learned_spec(adapted, declared)  # masks read as declared, as build checks them
    options = VerifyOptions(**_sweep(seed, n_random, None, None), latency=False)
    cases = verify_module(spec.name, adapted, spec, file, options)
    failed = [c for c in cases if not c.passed]
    if failed:
        lines = [f"{file.name} differs from {type(module).__name__} in {len(failed)} of {len(cases)} cases:"]
        for c in failed:
            sizes = format_sizes(c.sizes)
            lines.append(f"  {c.shape} ({sizes}, seed {c.seed}): {'; '.join(c.reasons())}")
            lines += [f"    note: {n}" for n in c.notes]
        raise AssertionError("\n".join(lines))
