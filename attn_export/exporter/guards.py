"""The guards a spec accepts (``accept_guards``): the conditions on the dims that torch's
trace assumed, read from the exported program (the guards its shape environment added, the
runtime asserts it deferred, the ranges it narrowed), each with sizes inside the declared
range where it fails. There the module's code takes another path than the graph, so build
smoke-checks those sizes and verify sweeps them: a graph traced past ``if seq == 7`` passed
every other point of its range.

Only conditions on the spec's dims are kept: one on a size made inside the module (a
cache's own length) cannot be steered from the inputs.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from attn_export.errors import ExportFailure
from attn_export.model_spec import Guard, ModelSpec

__all__ = ["accepted_guards", "refuse_fixed_dims"]

#: Where numpy cannot evaluate a condition as sympy does, a dim's range is tried size by size
#: up to this width, a wider one at its ends and next to the condition's own constants.
_SCAN = 1024
#: Points kept per condition, and per spec: each is one more golden case and sweep point. A
#: condition past the spec's share is kept without points, and build says it is unchecked.
_PER_GUARD = 3
_PER_SPEC = 32
#: torch's integer functions in a condition, for numpy (``sympy.lambdify``).
_NUMPY = {
    "FloorDiv": np.floor_divide,
    "CleanDiv": np.floor_divide,
    "PythonMod": np.mod,
    "Mod": np.mod,
    "ModularIndexing": lambda base, divisor, modulus: (base // divisor) % modulus,
    "Max": np.maximum,
    "Min": np.minimum,
}


def accepted_guards(
    program: Any, spec: ModelSpec, sizes: Mapping[str, int], located: Mapping[str, str]
) -> tuple[Guard, ...]:
    """The conditions ``program`` (traced at ``sizes``) holds only for part of the declared
    range, each with where it fails; ``located`` maps a condition as torch prints it to the
    module's line that made it."""
    symbols = _dim_symbols(program, spec)
    env = _shape_env(program)
    canonical = {_canonical(logged, env): at for logged, at in reversed(list(located.items()))}  # first wins
    found = [(expr, _where(expr, canonical)) for expr in _conditions(program, env, spec, symbols)]
    guards: list[Guard] = []
    taken: list[dict[str, int]] = []
    for expr, where in sorted(found, key=lambda f: not f[1]):  # the module's own lines first
        failing = _failing(expr, symbols, spec, sizes)
        points = [p for p in failing if p not in taken][: _PER_SPEC - len(taken)]
        if failing and (points or len(taken) == _PER_SPEC):  # else: checked at another's points
            taken += points
            guards.append(Guard(_render(expr, symbols), where, tuple(points)))
    return tuple(guards)


def refuse_fixed_dims(program: Any, spec: ModelSpec, located: Mapping[str, str]) -> None:
    """``ExportFailure`` where the trace fixed spec dims to the example's sizes (code that
    computes with a size as a Python number: ``math.log(seq)``): the graph then holds at
    those sizes only, which no guard point can cover; each named with the lines that set
    a size equal to its own (all such lines where none solves to it)."""
    user = _user_inputs(program)
    if len(user) != len(spec.inputs):
        return
    fixed: dict[str, str] = {}
    for node, tensor in zip(user, spec.inputs, strict=True):
        shape = getattr(node.meta.get("val"), "shape", ())
        for axis, (dim, size) in enumerate(zip(tensor.shape, shape, strict=False)):
            if isinstance(dim, str) and isinstance(size, int) and dim not in fixed:
                fixed[dim] = f"dim '{dim}' (input '{tensor.name}', axis {axis}) to the example's size {size}"
                fixed[dim] += _lines_fixing(size, located)
    if fixed:
        raise ExportFailure(
            f"{spec.name}: the module's code fixes {'; '.join(fixed.values())}, so the graph holds at "
            f"{'that size' if len(fixed) == 1 else 'those sizes'} only, whatever accept_guards lets through; "
            "compute with the size as a tensor, or declare the axis static"
        )


def _lines_fixing(size: int, located: Mapping[str, str]) -> str:
    """`` at line; line`` of the conditions setting one size equal to a number that solve to
    ``size`` (``Eq(s27 + 1, 4)`` for 3), else of every such condition; "" where none has a line."""
    lines = [(at, _solves_to(condition)) for condition, at in located.items() if at and _fixes_one_size(condition)]
    chosen = list(dict.fromkeys(at for at, value in lines if value == size) or dict.fromkeys(at for at, _ in lines))
    return f" at {'; '.join(chosen)}" if chosen else ""


def _solves_to(condition: str) -> int | None:
    """The one integer the size in ``Eq(expr, n)`` must be, or None."""
    import sympy

    try:
        expr = sympy.sympify(condition)
        solutions = sympy.solve(expr, *expr.free_symbols)
    except (sympy.SympifyError, TypeError, ValueError, NotImplementedError):
        return None
    return int(solutions[0]) if len(solutions) == 1 and getattr(solutions[0], "is_integer", False) else None


def _fixes_one_size(condition: str) -> bool:
    """``Eq(s27 + 1, 4)``: one size set equal to a number (not two sizes to each other)."""
    return condition.startswith("Eq(") and len(set(re.findall(r"\b[a-z]+\d+\b", condition))) == 1


def _user_inputs(program: Any) -> list[Any]:
    """The program's placeholders for forward()'s inputs, in order."""
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    return [nodes[name] for name in program.graph_signature.user_inputs if name in nodes]


def _canonical(text: str, env: Any) -> str:
    """``text`` (a condition as torch logged it) with each symbol torch later found equal to
    another (the batch of two inputs) written as that one, as the program's conditions are."""
    same = {str(k): str(v) for k, v in getattr(env, "replacements", {}).items() if v.is_Symbol}
    return re.sub(r"\b[a-z]+\d+\b", lambda m: same.get(m.group(0), m.group(0)), text)


def _where(expr: Any, located: Mapping[str, str]) -> str:
    """The line that made ``expr`` (``located``: each logged condition, canonical); for a range
    torch narrowed (``>=``, ``<=``), the line of the first comparison of the same sizes it
    logged. Torch's own assumptions (a size is not 1) have none."""
    if str(expr) in located:
        return located[str(expr)]
    if getattr(expr, "rel_op", None) not in (">=", "<="):
        return ""
    sizes = [re.compile(rf"\b{s}\b") for s in map(str, expr.free_symbols)]
    compared = {k: v for k, v in located.items() if not k.startswith(("Eq(", "Ne("))}
    return next((at for logged, at in compared.items() if all(n.search(logged) for n in sizes)), "")


def _shape_env(program: Any) -> Any:
    for node in program.graph.nodes:
        for size in getattr(node.meta.get("val"), "shape", ()):
            env = getattr(getattr(size, "node", None), "shape_env", None)
            if env is not None:
                return env
    return None


def _dim_symbols(program: Any, spec: ModelSpec) -> dict[Any, str]:
    """Each symbol that sizes an input axis, with the spec dim it stands for."""
    user = _user_inputs(program)
    symbols: dict[Any, str] = {}
    if len(user) != len(spec.inputs):
        return symbols
    for node, tensor in zip(user, spec.inputs, strict=True):
        shape = getattr(node.meta.get("val"), "shape", ())
        for dim, size in zip(tensor.shape, shape, strict=False):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if isinstance(dim, str) and getattr(expr, "is_Symbol", False):
                symbols.setdefault(expr, dim)
    return symbols


def _conditions(program: Any, env: Any, spec: ModelSpec, symbols: Mapping[Any, str]) -> list[Any]:
    """Every condition on the spec's dims alone, once, in the order torch made them."""
    import sympy

    found = [g.expr for g in getattr(env, "guards", ())]
    found += [a.expr for asserts in getattr(env, "deferred_runtime_asserts", {}).values() for a in asserts]
    for symbol, dim in symbols.items():
        declared, traced = spec.dims[dim], program.range_constraints.get(symbol)
        if declared.parts or traced is None:
            continue
        if traced.lower.is_integer and int(traced.lower) > declared.min:
            found.append(sympy.Ge(symbol, int(traced.lower)))
        if traced.upper.is_integer and int(traced.upper) < declared.max:
            found.append(sympy.Le(symbol, int(traced.upper)))
    unique: dict[str, Any] = {}
    for expr in found:
        if expr.free_symbols and expr.free_symbols <= set(symbols):
            unique.setdefault(str(expr), expr)
    return list(unique.values())


def _render(expr: Any, symbols: Mapping[Any, str]) -> str:
    """``expr`` in the spec's dim names: ``seq != 7``."""
    import sympy

    named = expr.xreplace({s: sympy.Symbol(d) for s, d in symbols.items()})
    op = getattr(named, "rel_op", None)
    return f"{named.lhs} {op} {named.rhs}" if op else str(named)


def _holds(expr: Any, symbols: Mapping[Any, str], spec: ModelSpec, free: Mapping[str, int]) -> bool:
    """Whether ``expr`` holds at the free dims' sizes ``free`` (an undecidable one counts as held)."""
    import sympy

    sizes = spec.with_sums(free)
    value = expr.xreplace({s: sympy.Integer(sizes[d]) for s, d in symbols.items() if s in expr.free_symbols})
    return value is not sympy.false


def _vectorized(expr: Any) -> Any:
    """``expr`` as a numpy function of its symbols in ``str`` order; None where numpy lacks one."""
    import sympy

    try:
        return sympy.lambdify(sorted(expr.free_symbols, key=str), expr, modules=[_NUMPY, "numpy"])
    except Exception:  # noqa: BLE001 - a function numpy lacks: sympy, one size at a time
        return None


def _held(
    expr: Any, vectorized: Any, symbols: Mapping[Any, str], spec: ModelSpec, base: dict[str, int], tried: str
) -> tuple[list[int], list[bool]]:
    """Sizes of dim ``tried`` (the others at ``base``) and whether ``expr`` holds at each: over
    the whole range with numpy (``vectorized``) where it evaluates ``expr`` as sympy does at
    the range's ends and middle, else one size at a time (a wide range at its ends and the
    constants' sides)."""
    low, high = spec.free_dims[tried].min, spec.free_dims[tried].max
    ordered = sorted(expr.free_symbols, key=str)
    values = np.arange(low, high + 1, dtype=np.int64)
    sums = spec.with_sums(base)
    args = [
        values + (sums[d] - base[tried]) if d == tried or tried in spec.dims[d].parts else np.int64(sums[d])
        for d in (symbols[s] for s in ordered)
    ]
    try:
        held = np.broadcast_to(np.asarray(vectorized(*args)), values.shape)
        probe = sorted({0, len(values) // 2, len(values) - 1})
        if held.dtype == bool and all(
            held[i] == _holds(expr, symbols, spec, base | {tried: int(values[i])}) for i in probe
        ):
            return values.tolist(), held.tolist()
    except Exception:  # noqa: BLE001 - a function numpy lacks: sympy, one size at a time
        pass
    if high - low <= _SCAN:
        tried_sizes = list(range(low, high + 1))
    else:
        near = {int(a) + d for a in expr.atoms() if getattr(a, "is_Integer", False) for d in (-1, 0, 1)}
        tried_sizes = sorted({low, high} | {n for n in near if low <= n <= high})
    return tried_sizes, [_holds(expr, symbols, spec, base | {tried: v}) for v in tried_sizes]


def _failing(expr: Any, symbols: Mapping[Any, str], spec: ModelSpec, sizes: Mapping[str, int]) -> list[dict[str, int]]:
    """Free-dim sizes where ``expr`` fails, next to where it holds: one dim is tried over its
    range while the others sit at the traced size, their minimum or their maximum."""
    free = spec.free_dims
    named = {symbols[s] for s in expr.free_symbols}
    varying = [d for d in free if d in named or any(d in spec.dims[n].parts for n in named)]
    points: list[dict[str, int]] = []
    vectorized = _vectorized(expr)
    for tried in varying:
        others = [d for d in varying if d != tried]
        for fixed in itertools.product(*[(sizes[d], free[d].min, free[d].max) for d in others]):
            base = {k: sizes[k] for k in free} | dict(zip(others, fixed, strict=True))
            values, held = _held(expr, vectorized, symbols, spec, base, tried)
            fails = [v for i, v in enumerate(values) if not held[i]]
            edges = [
                v
                for i, v in enumerate(values)
                if not held[i] and ((i > 0 and held[i - 1]) or (i + 1 < len(values) and held[i + 1]))
            ]
            for v in edges or fails[:1]:
                point = base | {tried: v}
                if point not in points:
                    points.append(point)
                if len(points) == _PER_GUARD:
                    return points
    return points
