"""How one value of a region is judged against PyTorch's: the spec's tolerance widened by
the roundings of the dtypes involved, with the padded query rows the spec leaves out taken
as PyTorch's (no region is blamed for what the outputs are not judged on)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from attn_export.compare.outputs import rms_of
from attn_export.model_spec import Tolerance

__all__ = [
    "INT4_REGION_SHARE",
    "ROUNDINGS",
    "beyond",
    "held",
    "judged_elements",
    "left_out",
    "in_float16",
    "nudged",
    "region_tolerance",
    "representable",
]

#: A region run alone may differ from PyTorch by this many float32 roundings of the
#: largest magnitude in its value, besides the spec's tolerance: an op fed the same inputs
#: rounds differently (summation order), never by more.
ROUNDINGS = 64
#: What int4's blocks do to a region, as a share of its value's rms: a block's weights are
#: rounded to 8 levels of its peak (about 2.3 x their rms over 32 Gaussian weights), so by
#: about 2.3 / 8 / sqrt(12) = 8 % of their rms, and a right graph's projection regions are
#: that far from PyTorch's (outputs get a simulated rounding's room instead, which regions,
#: run on PyTorch's own values, have not). Twice that bounds the error's rms, and three times
#: that one element's (the worst of 10^5 Gaussian errors is 4.4 times their rms): the key
#: projection's scales doubled still breaks both (``tests/exporter/test_static_cache.py``); a
#: fault in one block of a wide row moves its rms less, and is left to the outputs' room.
INT4_REGION_SHARE = 0.16
#: A region of a graph that computes in float16 (the fp16 variant's rounding) may differ from
#: PyTorch by this many float16 roundings of its value's largest magnitude, whatever dtype
#: its output is cast to: fed PyTorch's values rounded to float16, its own error is that of
#: its few float16 ops, not the whole graph's that the variant's shares of the rms (and its
#: 1 % rtol) hold. Measured on right fp16 graphs of 13 of the tiny zoo's models (188 cases:
#: every distribution, seeds 0-4 or 0-2): at most 6.7 (a causal LM's RMSNorm rsqrt); a key
#: projection 3 % off is about 30, which the shares let through (the output projection blamed).
FLOAT16_ROUNDINGS = 16


def in_float16(tol: Tolerance) -> bool:
    """Whether ``tol`` is a graph's that computes in float16 (the fp16 variant's rounding)."""
    return tol.int8_rounding and tol.weight_bits == 16


def nudged(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with each float moved to a neighbouring float16 value, up or down, drawn per
    element (a float32 one to its float16 value's neighbour): what a region computes from them
    against what it computes from ``feeds`` says how far float16's rounding of its inputs moves
    its value (a Softmax of large scores: a unit of a score moves its probabilities by that
    much), which its own roundings do not bound."""
    rng = np.random.default_rng(0)  # the same moves on every run of a case
    out = {}
    for name, value in feeds.items():
        if value.dtype.kind != "f":
            out[name] = value
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # beyond float16's range: left as it was
            half = value.astype(np.float16)
            up = rng.random(value.shape) < 0.5
            moved = np.where(up, np.nextafter(half, np.float16(np.inf)), np.nextafter(half, np.float16(-np.inf)))
            out[name] = np.where(np.isfinite(half) & np.isfinite(moved), moved, value).astype(value.dtype)
    return out


def region_tolerance(
    tol: Tolerance, expected: np.ndarray, computed: np.dtype | None = None, ties: float = 0.0
) -> Tolerance:
    """The spec's tolerance (its shares of the value's rms kept, for ``judge_value``: a region
    that scales its value breaks no element's bound, only its error's rms) widened by
    ``ROUNDINGS`` roundings of the value's largest finite magnitude, in the coarser of
    PyTorch's dtype and the graph's (``computed``: float16 inside an fp16 variant); NaN and
    infinity where PyTorch has them agree. An int4 variant's error rms may reach
    ``INT4_REGION_SHARE`` of the value's rms, an element's three times that, where it is
    judged against the float module; against int4's simulation, each element may stray
    ``ties`` besides (how far its near ties move the value, ``values.simulated_values``), no
    more than that element room of int4's (a recorded tie is data: a wider one excused any
    region). A graph computing in float16 (the fp16 variant's tolerance) is held to
    ``FLOAT16_ROUNDINGS`` float16 roundings of that magnitude instead, besides the atol and
    ``ties`` (there: how far its inputs' float16 rounding moves its value, ``nudged``)."""
    scale = float(np.abs(expected[np.isfinite(expected)]).max(initial=0.0)) if expected.dtype.kind == "f" else 0.0
    if in_float16(tol):  # its own roundings and its inputs' (``ties``: ``nudged``), not the variant's shares
        eps = float(np.finfo(np.float16).eps) if expected.dtype.kind == "f" else 0.0
        return Tolerance(tol.atol + FLOAT16_ROUNDINGS * eps * scale + ties, 0.0, allow_nan=True)
    floats = [d for d in (expected.dtype, computed) if d is not None and np.dtype(d).kind == "f"]
    eps = max((float(np.finfo(d).eps) for d in floats), default=0.0)
    if tol.weight_bits == 4:
        tol = dataclasses.replace(
            tol, rms_rtol=max(tol.rms_rtol, INT4_REGION_SHARE), atol_rms=max(tol.atol_rms, 3 * INT4_REGION_SHARE)
        )
    ties = min(ties, 3 * INT4_REGION_SHARE * rms_of(expected)) if ties else 0.0
    return dataclasses.replace(tol, atol=tol.atol + ROUNDINGS * eps * scale + ties, allow_nan=True)


def representable(value: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    """PyTorch's ``value`` as a graph computing in ``dtype`` holds it: its finite elements
    clipped to that float dtype's range where it is narrower. The fp16 variant clamps its
    constants to +-65504 (a cast would make them infinite), so where PyTorch fills masked
    scores with float32's lowest, a right graph holds -65504: judged against -3.4e38, the
    mask was blamed."""
    if dtype is None or value.dtype.kind != "f" or np.dtype(dtype).kind != "f":
        return value
    top = float(np.finfo(dtype).max)
    if top >= float(np.finfo(value.dtype).max):
        return value
    return np.where(np.isfinite(value), np.clip(value, -top, top), value).astype(value.dtype)


def beyond(value: np.ndarray, dtype: np.dtype | None) -> bool:
    """Whether any finite element of PyTorch's float ``value`` lies beyond what ``dtype``
    holds (float16's 65504): fed to a region in that dtype, it is clipped, and what the
    region computes from it is not PyTorch's value on any input PyTorch gave."""
    if dtype is None or value.dtype.kind != "f" or np.dtype(dtype).kind != "f":
        return False
    top = float(np.finfo(dtype).max)
    return top < float(np.finfo(value.dtype).max) and bool((np.abs(value[np.isfinite(value)]) > top).any())


def held(value: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """The graph's ``actual`` with an overflow taken as the largest value its dtype holds,
    where PyTorch's ``value`` is beyond that dtype's range, or within ``FLOAT16_ROUNDINGS``
    of its roundings of it, and of the same sign: a float16 MatMul whose true value exceeds
    65504 gives infinity, which ``representable`` clips PyTorch's to, no fault of the graph
    (the fp16 variant's range, on large values); one of 65400 may round past it."""
    if actual.dtype.kind != "f" or value.dtype.kind != "f" or actual.shape != value.shape:
        return actual
    top = float(np.finfo(actual.dtype).max)
    if top >= float(np.finfo(value.dtype).max):
        return actual
    near = top * (1 - FLOAT16_ROUNDINGS * float(np.finfo(actual.dtype).eps))
    with np.errstate(invalid="ignore"):
        over = np.isinf(actual) & np.isfinite(value) & (np.abs(value) > near) & (np.sign(actual) == np.sign(value))
    return np.where(over, np.sign(value) * top, actual).astype(actual.dtype) if over.any() else actual


def _row_selector(shape: tuple[int, ...], rows: np.ndarray) -> np.ndarray | None:
    """The elements of a value ``[batch, ..., query, ...]`` at the padded ``rows`` ``[batch,
    query]``: batch is the first axis, query the first later axis of the query's size; None
    when the value has no such axes."""
    batch, query = rows.shape
    if len(shape) < 2 or shape[0] != batch:
        return None
    axis = next((a for a in range(1, len(shape)) if shape[a] == query), None)
    if axis is None:
        return None
    view = [1] * len(shape)
    view[0], view[axis] = batch, query
    return np.broadcast_to(rows.reshape(view), shape)


def judged_elements(shape: tuple[int, ...], rows: np.ndarray | None) -> int:
    """How many elements of a value of ``shape`` are judged: all but those on the padded
    ``rows`` left out (``left_out``)."""
    selector = None if rows is None else _row_selector(shape, rows)
    return int(np.prod(shape)) if selector is None else int(np.count_nonzero(~selector))


def left_out(expected: np.ndarray, actual: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """``actual`` in PyTorch's float dtype (an fp16 variant computes in float16 inside;
    the tolerance says how much that costs), with PyTorch's values on the padded query
    rows that the spec leaves out (``fully_masked = "ignore"``), as the outputs are judged:
    no region is blamed for them."""
    if actual.dtype != expected.dtype and actual.dtype.kind == expected.dtype.kind == "f":
        actual = actual.astype(expected.dtype)
    if rows is None or actual.shape != expected.shape:
        return actual
    selector = _row_selector(expected.shape, rows)
    return actual if selector is None else np.where(selector, expected, actual)
