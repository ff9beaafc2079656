"""Fully masked rows: what each runner gives there, build's repair where the graph differs
from PyTorch, and the comparisons verify makes under the spec's ``fully_masked``.

What a row gives is told apart by running the graph rewritten both ways
(``exporter.masked_softmax``), or the same model's plain export where the graph has nothing
to rewrite: "0" (PyTorch's safe softmax), "mean of V" (uniform weights), "NaN", "other", or
"unknown" where neither can be rewritten and the output there is neither 0 nor NaN (the two
that show by themselves). The rewrites are
also the repairs: where PyTorch gives one of them and the graph does not, build keeps the
rewritten graph, checked and compared like any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from attn_export.artifacts.golden import GoldenCase, Sight
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.checks.causality import query_dims
from attn_export.compare import OutputComparison, compare_outputs
from attn_export.errors import AttnExportError, GraphCheckError, RuntimeFailure
from attn_export.exporter.graph_checks import check_model, check_spec_axes
from attn_export.exporter.masked_softmax import REWRITES, rewrite_softmax
from attn_export.model_spec import ModelSpec, Rounding, Tolerance
from attn_export.model_spec.cache import cache_of, output_shape
from attn_export.model_spec.distributions import DEFAULT as DEFAULT_DISTRIBUTION
from attn_export.model_spec.distributions import split_label
from attn_export.model_spec.masks import CASES, masked_row_selector
from attn_export.runtimes.ort import OnnxRuntime

__all__ = ["FullyMaskedRows", "judge", "padded_query_rows", "padded_rows_agree", "padded_tokens", "settle"]

#: What fully masked rows give where nothing in the graph can be rewritten to tell and they
#: are neither 0 nor NaN, or where the case has no such row.
UNSEEN = "unknown"
#: Why padded query rows are treated as fully masked, in every note and message that says so.
PADDED = "padding that sees no real token under the module's own causal mask or window"


def _declared_before(spec: ModelSpec) -> int | None:
    """How many positions before itself a query sees under the module's own window, where
    the spec says: its ``[cache] window`` (itself and the N before it) or a Hugging Face
    config's ``sliding_window`` (itself and the N - 1 before it); None: all of them."""
    if spec.cache_window is not None:
        return spec.cache_window
    window = (spec.config or {}).get("sliding_window")
    return window - 1 if isinstance(window, int) and window > 0 else None


def _keyless(spec: ModelSpec, keep: np.ndarray, sight: Sight) -> np.ndarray:
    """``[batch, key]`` True where a query at that key position would see no kept key, the
    positions it sees taken from the module (``sight``; a window wider than the probed
    cases from the spec): a left-padded prompt's rows before its first real token under a causal
    mask, padding further than the window from every real token, and in an encoder only
    a sequence with no real token at all. A padded token with a kept key in sight is a row
    like any other."""
    before = sight.before if sight.before is not None else _declared_before(spec)
    n = keep.shape[-1]
    kept = np.concatenate([np.zeros_like(keep[:, :1], dtype=np.int64), np.cumsum(keep, axis=-1)], axis=-1)
    positions = np.arange(n)
    first = np.zeros(n, dtype=np.int64) if before is None else np.maximum(positions - before, 0)
    stop = np.full(n, n) if sight.after is None else np.minimum(positions + sight.after + 1, n)
    return (kept[:, stop] - kept[:, first]) == 0


def padded_tokens(spec: ModelSpec, case: GoldenCase) -> np.ndarray | None:
    """``[batch, query]`` True where a padded query row may see no key (``padded_query_rows``,
    every self-attention key-padding mask of the spec, over this case's new tokens); None
    where the spec has none.
    Intermediate values are matched to it by their batch and query sizes (``localize``)."""
    rows: np.ndarray | None = None
    dims = query_dims(spec)
    for t, mask in spec.masks:
        query = dims.get(t.name)
        if query is None:
            continue
        parts = spec.dims[t.shape[1]].parts if t.shape[1] in spec.dims else ()
        offset = sum(case.sizes[p] for p in parts[:-1])
        keyless = _keyless(spec, mask.keep(case.inputs[t.name]), case.sight(t.name))
        padded = keyless[:, offset : offset + case.sizes[query]]
        rows = padded if rows is None or rows.shape != padded.shape else rows | padded
    return rows


def padded_query_rows(spec: ModelSpec, case: GoldenCase) -> tuple[dict[str, np.ndarray], int]:
    """Per output, the elements of padded query rows that may see no key, and how many such
    rows there are. In self-attention a key-padding mask marks tokens, and a query row at a
    masked token is padding too: where no kept key is in its sight (``case.sight``: before
    it under a causal mask, within a window, anywhere in an encoder), the module's own mask
    leaves it no key at all (a left-padded prompt, padding longer than the window, a
    sequence with no real token), and there PyTorch and any graph differ. Any other padded
    row sees a real key, and is compared like every row. An output's rows are the query
    dim's, or the key dim's where it is a sum whose other parts come first (``total_seq =
    "past_seq + seq"``: the presents hold the cached tokens, then the new ones)."""
    out: dict[str, np.ndarray] = {}
    count = 0
    dims = query_dims(spec)
    for t, mask in spec.masks:
        if t.name not in dims:
            continue
        batch, key, query = t.shape[0], str(t.shape[1]), dims[t.name]  # a str: query_dims says so
        parts = spec.dims[key].parts if key in spec.dims else ()
        keyless = _keyless(spec, mask.keep(case.inputs[t.name]), case.sight(t.name))
        for o in spec.outputs:
            rows_dim = key if key in o.shape else query if query in o.shape else None
            if rows_dim is None or batch not in o.shape or rows_dim == batch:
                continue
            offset = sum(case.sizes[p] for p in parts[:-1]) if rows_dim != key else 0
            b_axis, q_axis = o.shape.index(batch), o.shape.index(rows_dim)
            sizes = output_shape(spec, o, case.sizes)
            # a sliding-window present holds only the newest of the tokens
            stop = offset + case.sizes[rows_dim]
            rows = keyless[:, stop - sizes[q_axis] : stop]
            shape = [1] * len(o.shape)
            shape[b_axis], shape[q_axis] = rows.shape
            picked = np.broadcast_to((rows if b_axis < q_axis else rows.T).reshape(shape), sizes)
            out[o.name] = out[o.name] | picked if o.name in out else picked
            count = max(count, int(rows.sum()))
    return out, count


def padded_rows_agree(
    spec: ModelSpec, case: GoldenCase, actual: Mapping[str, np.ndarray], tolerances: Mapping[str, Tolerance]
) -> bool:
    """Whether ``actual`` agrees with PyTorch's outputs on the padded query rows that see no
    key (``padded_query_rows``; True where there are none): an output with those rows
    compared there alone, one without them (a sum over the rows) whole, since what the
    rows gave may be in it."""
    padded, count = padded_query_rows(spec, case)
    if not count:
        return True
    if not case.outputs.keys() <= actual.keys():
        return False  # an output the graph did not give (it failed to run) agrees nowhere
    others = {name: ~rows for name, rows in padded.items()}
    compared = compare_outputs(
        _blank(case.outputs, others), _blank(actual, others), tolerances, case.floors, int8=case.int8
    )
    return all(c.passed for c in compared)


def _rows(count: int) -> str:
    return f"{count} padded query row{'s' if count != 1 else ''}"


def judge(
    spec: ModelSpec, case: GoldenCase, actual: Mapping[str, np.ndarray], tolerances: Mapping[str, Tolerance]
) -> tuple[list[OutputComparison], list[str]]:
    """A case's comparisons with its padded query rows (``padded_query_rows``) treated as
    fully masked: left out under ``fully_masked = "ignore"`` (and a note says how many),
    compared under "match", where a failure found only in them says so."""
    padded, count = padded_query_rows(spec, case)
    if not count:
        return compare_outputs(case.outputs, actual, tolerances, case.floors, int8=case.int8), []
    if spec.fully_masked == "ignore":
        comparisons = _compare_left_out(case, actual, padded, tolerances)
        return comparisons, [f'fully_masked = "ignore": {_rows(count)} not compared ({PADDED})']
    comparisons = compare_outputs(case.outputs, actual, tolerances, case.floors, int8=case.int8)
    blanked = compare_outputs(
        _blank(case.outputs, padded), _blank(actual, padded), tolerances, case.floors, padded, case.int8
    )
    if not all(c.passed for c in comparisons) and all(c.passed for c in blanked):
        return comparisons, [
            f"every difference is in {_rows(count)} ({PADDED}); "
            'set fully_masked = "ignore" in the spec to leave them out'
        ]
    return comparisons, []


def _compare_left_out(
    case: GoldenCase,
    actual: Mapping[str, np.ndarray],
    selectors: Mapping[str, np.ndarray],
    tolerances: Mapping[str, Tolerance],
) -> list[OutputComparison]:
    """``compare_outputs`` on a case with the selected elements left out: blanked on both
    sides and not counted in their output's total, so that a case whose every element is
    left out compared nothing, and does not pass."""
    expected = case.outputs
    compared = compare_outputs(
        _blank(expected, selectors), _blank(actual, selectors), tolerances, case.floors, selectors, case.int8
    )
    return [
        dataclasses.replace(c, total=c.total - int(selectors[c.name].sum()))
        if c.name in selectors and selectors[c.name].shape == expected[c.name].shape
        else c
        for c in compared
    ]


def _blank(values: Mapping[str, np.ndarray], selectors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``values`` with the selected elements set to 0 (where the shapes fit)."""
    out = dict(values)
    for name, sel in selectors.items():
        if name in out and out[name].shape == sel.shape:
            out[name] = np.where(sel, np.zeros((), out[name].dtype), out[name])
    return out


def _agree(
    expected: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    tol: Mapping[str, Tolerance],
    rounding: Mapping[str, Rounding] | None = None,
) -> bool:
    return all(c.passed for c in compare_outputs(expected, actual, tol, int8=rounding))


def _matches(case: GoldenCase, actual: Mapping[str, np.ndarray], tol: Mapping[str, Tolerance]) -> bool:
    """``actual`` agrees with PyTorch's outputs in ``case`` as the smoke check judges it:
    with the case's float32 floor and int8 rounding."""
    return all(c.passed for c in compare_outputs(case.outputs, actual, tol, case.floors, int8=case.int8))


class FullyMaskedRows:
    """Judges the named mask cases of one graph; the rewritten graphs it classifies with
    are made and loaded on first use (ONNX Runtime, CPU, each session's arena held to
    ``budget``: ``runtimes.ort.load_session``).

    ``plain`` is the same model's plain export (a file, or a function that makes it), whose
    rewrites tell what each side gives where this graph has nothing to rewrite (a fused
    attention op): PyTorch's rows are PyTorch's whichever graph it is judged with."""

    def __init__(
        self,
        spec: ModelSpec,
        model: Path | bytes,
        tolerances: Mapping[str, Tolerance],
        budget: int | None = None,
        plain: Path | Callable[[], bytes] | None = None,
    ) -> None:
        self.spec = spec
        self.model = model
        self.tolerances = dict(tolerances)
        self.budget = budget
        self.plain = plain
        self._rewritten: dict[str, tuple[bytes, int]] = {}
        self._sessions: dict[str, OnnxRuntime] = {}
        self._labeller: FullyMaskedRows | None = None

    def rewritten(self, mode: str) -> tuple[bytes, int]:
        """The graph with every Softmax rewritten (``masked_softmax.REWRITES``), and how many were."""
        if mode not in self._rewritten:
            proto = load_model_file(self.model) if isinstance(self.model, Path) else onnx.load_from_string(self.model)
            rewritten, count = rewrite_softmax(proto, mode)
            self._rewritten[mode] = (rewritten.SerializeToString(deterministic=True), count)
        return self._rewritten[mode]

    def _run(self, mode: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if mode not in self._sessions:
            spec = self.spec
            model = self.rewritten(mode)[0]
            self._sessions[mode] = OnnxRuntime(model, spec.inputs, spec.outputs, spec.dims, budget=self.budget)
            self._sessions[mode].activate()
        return self._sessions[mode].run(feeds)

    def __enter__(self) -> FullyMaskedRows:
        return self

    def __exit__(self, *exc: object) -> None:
        for session in self._sessions.values():
            session.deactivate()
        self._sessions.clear()
        if self._labeller is not None:
            self._labeller.__exit__()

    def _references(self, case: GoldenCase) -> dict[str, dict[str, np.ndarray]]:
        """The graph's outputs rewritten each way (``REWRITES``' names) in ``case``'s fully
        masked rows: this graph's, else the plain export's; empty where neither has anything
        to rewrite, or where the plain export cannot be made or run (it only labels)."""
        if self.rewritten("zero")[1]:
            return {REWRITES[mode]: self._run(mode, case.inputs) for mode in REWRITES}
        if self.plain is None:
            return {}
        try:
            if self._labeller is None:
                model = self.plain if isinstance(self.plain, Path) else self.plain()
                self._labeller = FullyMaskedRows(self.spec, model, self.tolerances, self.budget)
            labeller = self._labeller
            if not labeller.rewritten("zero")[1]:
                return {}
            return {REWRITES[mode]: labeller._run(mode, case.inputs) for mode in REWRITES}
        except (AttnExportError, onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
            self.plain = None  # nothing to label with: rows read as where there is no plain export
            return {}

    def selectors(self, case: GoldenCase) -> dict[str, np.ndarray]:
        """Per output, the elements in rows that attend to nothing: any mask's fully masked
        rows, and the padded query rows that see no key (``padded_query_rows``)."""
        padded = padded_query_rows(self.spec, case)[0]
        out = {}
        for o in self.spec.outputs:
            sizes = output_shape(self.spec, o, case.sizes)
            sel = padded[o.name].copy() if o.name in padded else np.zeros(sizes, dtype=bool)
            for t, mask in self.spec.masks:
                keep = mask.keep(case.inputs[t.name])
                sel = sel | masked_row_selector(mask.layout, t.shape, keep, o.shape, sizes)
            out[o.name] = sel
        return out

    def behaviours(self, case: GoldenCase, *runs: Mapping[str, np.ndarray]) -> list[str]:
        """What each of ``runs`` gives in the fully masked rows of ``case``: in the attention's
        outputs, not in a cache's presents (the keys and values of padded tokens, which no
        softmax made: with them, 0 was never seen, and a module that gives 0 was said not to)."""
        presents = _presents(self.spec)
        sel = {name: s for name, s in self.selectors(case).items() if name not in presents}

        def rows(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {n: values[n][s] for n, s in sel.items() if n in values and values[n].shape == s.shape}

        tol = self.tolerances
        picked = [rows(values) for values in runs]
        if not any(v.size for p in picked for v in p.values()):
            return [UNSEEN for _ in runs]  # no element of this case is in a fully masked row
        refs = {name: rows(values) for name, values in self._references(case).items()}
        other = "other"
        if not refs or _agree(refs["0"], refs["mean of V"], tol):
            # Nothing the rewrites could tell apart: only 0 and NaN show by themselves.
            refs, other = {"0": {n: np.zeros_like(v) for n, v in picked[0].items()}}, UNSEEN
        found = []
        for values in picked:
            if not all(np.isfinite(v).all() for v in values.values() if v.dtype.kind == "f"):
                found.append("NaN")
                continue
            # a quantized graph's rewrite strays from PyTorch as far as its rounding does there
            found.append(next((name for name, ref in refs.items() if _agree(ref, values, tol, case.int8)), other))
        return found

    def compare(
        self, case: GoldenCase, actual: Mapping[str, np.ndarray], runners: tuple[str, str]
    ) -> tuple[list[OutputComparison], list[str]]:
        """Comparisons for one case, and notes for the report: a named mask case says what
        its fully masked rows give on both sides and, under ``fully_masked = "ignore"``,
        leaves them out."""
        if case.label not in CASES:
            return judge(self.spec, case, actual, self.tolerances)
        sel = self.selectors(case)
        if any(s.any() for s in sel.values()):
            expected_gives, actual_gives = self.behaviours(case, case.outputs, actual)
            notes = [f"fully masked rows: {runners[0]} gives {expected_gives}, {runners[1]} gives {actual_gives}"]
            if expected_gives == actual_gives == UNSEEN:
                notes = [
                    f"fully masked rows: neither {runners[0]} nor {runners[1]} gives 0 or NaN there, and no rewrite "
                    "of the graph's softmax tells what they give"
                ]
        else:  # both sides would be "unknown"
            notes = ["fully masked rows: none in this case (every query sees a key)"]
        if self.spec.fully_masked != "ignore":
            return compare_outputs(case.outputs, actual, self.tolerances, case.floors, int8=case.int8), notes
        count = padded_query_rows(self.spec, case)[1]  # its rows are in ``sel`` already (``selectors``)
        skipped, total = sum(int(s.sum()) for s in sel.values()), sum(s.size for s in sel.values())
        what = "rows attending to nothing" + (", padded query rows" if count else "")
        notes.append(f'fully_masked = "ignore": {skipped} of {total} output elements ({what}) not compared')
        return _compare_left_out(case, actual, sel, self.tolerances), notes


def settle(
    spec: ModelSpec,
    key: str,
    model: bytes,
    cases: Sequence[GoldenCase],
    tolerances: Mapping[str, Tolerance],
    plain: Callable[[], bytes] | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """The graph to keep, and what its fully masked rows give next to PyTorch's (``cases``
    hold PyTorch's outputs; ``plain`` makes the plain export, which labels them where the
    graph has nothing to rewrite). Where they differ and the spec says ``fully_masked =
    "match"``, the graph rewritten to give PyTorch's result, checked again; GraphCheckError
    where no rewrite does."""
    named = [c for c in cases if c.label in CASES]
    # A key-padding mask of one sequence has no mask case of its own (it would pad the only
    # sequence): the normal cases with padded query rows in an output of the attention
    # show what the graph and PyTorch give there.
    cases = named or [c for c in cases if split_label(c.label)[1] == DEFAULT_DISTRIBUTION and _padded_answers(spec, c)]
    if not cases:
        return model, {}
    with FullyMaskedRows(spec, model, tolerances, plain=plain) as rows:
        with OnnxRuntime(model, spec.inputs, spec.outputs, spec.dims) as session:
            runs = [(c, session.run(c.inputs)) for c in cases]
        gives = {
            c.label: dict(zip(("torch", "onnxruntime"), rows.behaviours(c, c.outputs, got), strict=True))
            for c, got in runs
        }
        info: dict[str, Any] = {"mode": spec.fully_masked, "cases": gives}
        if all(_matches(c, got, tolerances) for c, got in runs):
            # a lossy variant's room can hold rows that give another thing than PyTorch on
            # these cases and not on others (int4's on a small prompt): repaired where a rewrite does
            differ = any(g["torch"] != g["onnxruntime"] for g in gives.values())
            lossy = any(t.int8_rounding for t in tolerances.values())
            if differ and lossy and spec.fully_masked == "match":
                with contextlib.suppress(GraphCheckError):
                    return _repair(spec, key, rows, cases, gives, tolerances, info)
            return model, info
        if spec.fully_masked == "ignore":
            for c, got in runs:
                failed = [r.reason() for r in rows.compare(c, got, ("torch", "onnxruntime"))[0] if not r.passed]
                if failed:
                    raise GraphCheckError(f"{key}: {c.label}: rows that attend to something differ: {failed[0]}")
            return model, info
        return _repair(spec, key, rows, cases, gives, tolerances, info)


def _padded_answers(spec: ModelSpec, case: GoldenCase) -> bool:
    """Whether a padded query row that sees no key shows in an output other than a cache's
    presents (which hold the padded tokens' keys and values, made by no softmax)."""
    presents = _presents(spec)
    return any(rows.any() for name, rows in padded_query_rows(spec, case)[0].items() if name not in presents)


def _presents(spec: ModelSpec) -> set[str]:
    cache = cache_of(spec)
    return {present for _, present in cache.pairs} if cache is not None else set()


def _repair(
    spec: ModelSpec,
    key: str,
    rows: FullyMaskedRows,
    cases: list[GoldenCase],
    gives: dict[str, dict[str, str]],
    tolerances: Mapping[str, Tolerance],
    info: dict[str, Any],
) -> tuple[bytes, dict[str, Any]]:
    label = cases[0].label
    torch_gives, ort_gives = gives[label]["torch"], gives[label]["onnxruntime"]
    mode = next((m for m, result in REWRITES.items() if {g["torch"] for g in gives.values()} == {result}), None)
    if not rows.rewritten("zero")[1]:
        why = "the graph has no Softmax to rewrite (its attention is one fused op)"
    elif mode is None:
        why = f"PyTorch gives {torch_gives} there, which no rewrite reproduces"
    else:
        model, count = rows.rewritten(mode)
        try:
            with OnnxRuntime(model, spec.inputs, spec.outputs, spec.dims) as session:
                still = [c.label for c in cases if not _matches(c, session.run(c.inputs), tolerances)]
        except RuntimeFailure as e:
            raise GraphCheckError(
                f"{key}: fully masked rows ({label}): the graph rewritten to give {REWRITES[mode]} does not run: {e}"
            ) from e
        if not still:
            proto = onnx.load_from_string(model)
            check_model(proto, key)
            check_spec_axes(proto, key, spec)
            was = {c: g["onnxruntime"] for c, g in gives.items()}
            info["repair"] = {"rewrite": mode, "softmax_nodes": count, "gives": REWRITES[mode], "was": was}
            return model, info
        why = f"the graph rewritten to give {REWRITES[mode]} still differs at {', '.join(still)}"
    told = f"PyTorch gives {torch_gives}, onnxruntime[cpu] gives {ort_gives}"
    if torch_gives == ort_gives == "NaN":
        raise GraphCheckError(
            f"{key}: fully masked rows ({label}): PyTorch and onnxruntime[cpu] both give NaN there; set "
            '[tolerance] allow_nan = true in the spec to accept NaN on both sides, or fully_masked = "ignore" '
            "to leave those rows out"
        )
    raise GraphCheckError(
        f"{key}: fully masked rows ({label}): {told if torch_gives != UNSEEN else 'PyTorch and the graph differ'}; "
        f'{why}; set fully_masked = "ignore" in the spec to accept the difference'
    )
