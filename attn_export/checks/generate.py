"""Stage: greedy generation of a whole causal LM, judged by its tokens (``verify --generate N``).

PyTorch's own ``generate()`` (greedy, N new tokens) is the reference. The graph is run token by
token by our loop: the prompt with an empty cache, then one token a step, each step's presents
fed back as the next step's pasts, ``position_ids`` counted over the mask as transformers counts
them. Where onnxruntime-genai is installed and the graph fits it, its generator runs the graph
too (``runtimes.genai``), padding on the right as it does in deployment. Prompts are seeded: one
at batch 1 and a batch of two of different lengths (left-padded for PyTorch and our loop); for a
graph that takes no padding, also a batch of two of one length, which our loop runs. A graph
that reads each row's length off its mask (``gqa-rotary``, as genai's) takes no left padding
but pads on the right as genai's generator does, and our loop runs it so
(``padding_side``).

Tokens must match exactly, and each step's logits (of each row's last token) within the
variant's tolerance for ``logits``; a quantized graph (int8, int4) is held to PyTorch's
generation with its weights rounded as the variant rounds them; the first step that differs is named, with its row, the
two tokens and the first logit out of tolerance. After it the sequences part, so nothing
later is judged. A row whose graph picks another token on a near tie (its logits within the
tolerance, and favouring its token, where PyTorch's two are within what each may stray) is
no divergence: its texts part there, the row is judged no further, and a note says so.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from attn_export.artifacts.genai_folder import LOGITS, logits_vocab
from attn_export.artifacts.json_fields import json_record
from attn_export.errors import SpecError, UsageError
from attn_export.model_spec import ModelSpec, Tolerance, variant_chain
from attn_export.model_spec.cache import MASK, POSITIONS, cache_of
from attn_export.runtimes.base import Runtime
from attn_export.runtimes.genai import Generation

if TYPE_CHECKING:
    import onnx

__all__ = [
    "GenerateResult",
    "Judged",
    "Side",
    "generate_prompts",
    "graph_generate",
    "is_causal_lm",
    "judge",
    "padding_side",
    "stacked",
    "step_feeds",
    "torch_generate",
    "uneven",
]


@dataclass
class GenerateResult:
    """One generation compared: which runner, which prompts, and where it first differed."""

    model: str
    runner: str
    layout: str
    prompts: list[list[int]]
    steps: int
    expected: list[list[int]] = field(default_factory=list)
    got: list[list[int]] = field(default_factory=list)
    #: The largest logit difference at each step judged (up to the first that differs).
    max_abs_by_step: list[float] = field(default_factory=list)
    #: One line naming the first step, row, tokens and logit that differ; "" where all agree.
    divergence: str = ""
    #: The step (from 1) that first differs; None where every step agrees.
    step: int | None = None
    #: One line for each row that parted from PyTorch's tokens on a near tie its tolerance
    #: allows (``judge``): not a divergence, but that row's later steps were not judged.
    parted: list[str] = field(default_factory=list)
    #: The fewest tokens a row gave as PyTorch's before a near tie parted it; None where none did.
    agreed: int | None = None

    @property
    def passed(self) -> bool:
        return not self.divergence

    def agreed_of(self) -> str:
        """``agreed/steps``: the tokens every row gave as PyTorch's before it first differed
        or a near tie parted it."""
        ends = [self.steps, *([self.step - 1] if self.step else [])]
        ends += [self.agreed] if self.agreed is not None else []
        return f"{min(ends)}/{self.steps}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}

    @classmethod
    def from_dict(cls, d: Any, where: str = "generation") -> GenerateResult:
        """The generation ``to_dict`` wrote; ArtifactError naming the first field (``where.steps``)
        missing, unknown or not of its type: a generation is read from a report from anywhere."""
        return json_record(cls, d, where, derived=("passed",))


def is_causal_lm(spec: ModelSpec) -> bool:
    """Whether ``spec`` is a whole causal LM: a KV cache and ``logits`` sized by the vocabulary."""
    logits = next((t for t in spec.outputs if t.name == LOGITS), None)
    return logits is not None and isinstance(logits.shape[-1], int) and cache_of(spec) is not None


def generate_prompts(
    spec: ModelSpec, steps: int, seed: int, special: frozenset[int] = frozenset()
) -> dict[str, list[list[int]]]:
    """Seeded prompts by layout: one at batch 1, and (where the batch may be 2) two of
    different lengths, and two of one length where the mask takes no padding. Each fits the
    spec's ranges with ``steps`` new tokens after it; ids leave out the ``special`` tokens
    (pad, bos, eos: a generator masks a pad in a prompt) and the lowest three where the
    vocabulary allows. UsageError naming what to change where
    a causal LM cannot be run so."""
    cache = cache_of(spec)
    if not is_causal_lm(spec) or cache is None:
        raise SpecError(
            f"{spec.name}: --generate runs a causal LM with a KV cache and a {LOGITS} output whose last "
            "axis is the vocabulary (attn_export.zoo.hf_cache:CausalLMWithCache)"
        )
    inputs = {t.name: t for t in spec.inputs}
    if "input_ids" not in inputs or cache.mask is None:
        raise SpecError(f"{spec.name}: --generate feeds token ids and a mask: declare input_ids and {MASK} inputs")
    vocab = logits_vocab(spec)
    seq, past = spec.dims[cache.seq_dim], spec.dims[cache.past_dim]
    # the prompt's step has an empty cache; step k after it feeds a past of prompt + k - 1
    length = min(seq.max, past.max + 2 - steps, 6)
    if seq.min > 1 or past.min > 0:
        raise UsageError(
            f"{spec.name}: --generate decodes one token a step from an empty cache: [dims] {cache.seq_dim} must "
            f"reach 1 and {cache.past_dim} 0"
        )
    if length < 2:
        raise UsageError(
            f"{spec.name}: --generate {steps}: a prompt of 2 tokens and {steps} new ones need {cache.past_dim} up to "
            f"{steps}, and the spec declares {past.max}; generate fewer tokens or widen [dims] {cache.past_dim}"
        )
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(3 if vocab > 3 else 0, vocab) if t not in special])
    if not allowed.size:
        raise UsageError(f"{spec.name}: --generate: every id of the vocabulary of {vocab} is a special token")

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.choice(allowed, size=n)]

    batch = spec.dims.get(cache.batch_dim) if cache.batch_dim else None
    layouts = {"batch-1": [draw(length)]}
    if batch is not None and batch.max >= 2:
        layouts["padded"] = [draw(length), draw(max(1, length // 2))]
        if not cache.pads:
            layouts["same-length"] = [draw(length), draw(length)]
    return layouts


#: Where a batch's shorter prompts are padded: before them, as PyTorch's ``generate()`` is fed,
#: or after them, as onnxruntime-genai's generator feeds a graph that reads each row's length.
Side = Literal["left", "right"]


def padding_side(spec: ModelSpec, variant: str, graph: Callable[[], onnx.ModelProto] | None = None) -> Side | None:
    """Where our loop pads a batch of prompts of different lengths for ``spec``'s ``variant``
    graph: on the left where its mask pads, on the right where the graph reads each row's
    length off the mask (a variant that ``counts_positions``, as genai's graphs; or, for a
    ``graph`` built elsewhere and given with ``--spec``, loaded only if asked, a
    GroupQueryAttention whose lengths are the sums of a mask input's rows, as genai's model
    builder writes it), else nowhere (None: a graph that takes no padding runs prompts of
    one length)."""
    cache = cache_of(spec)
    if cache is not None and cache.pads:
        return "left"
    if variant_chain(variant).counts_positions:
        return "right"
    masks = {t.name for t, _ in spec.masks}
    return "right" if graph is not None and masks and _sums_rows(graph(), masks) else None


def _sums_rows(graph: onnx.ModelProto, masks: set[str]) -> bool:
    """Whether every GroupQueryAttention of an ONNX model takes its rows' lengths
    (``seqlens_k``, input 5) from a ReduceSum of one of the ``masks`` graph inputs: not
    through a Shape or Size, whose values are the mask's width alike for every row (a
    graph that takes each row as long as the batch is then fed no padding)."""
    made = {out: node for node in graph.graph.node for out in node.output}
    attention = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention" and len(n.input) > 5]

    def summed(value: str) -> bool:
        seen: set[tuple[str, bool]] = set()
        todo = [(value, False)]
        while todo:
            name, through_sum = todo.pop()
            if name in masks and through_sum:
                return True
            node = made.get(name)
            if node is None or (name, through_sum) in seen or node.op_type in ("Shape", "Size"):
                continue
            seen.add((name, through_sum))
            todo += [(i, through_sum or node.op_type == "ReduceSum") for i in node.input if i]
        return False

    return bool(attention) and all(summed(n.input[5]) for n in attention)


def uneven(rows: Sequence[Sequence[int]]) -> bool:
    """Whether prompts are of different lengths: a batch of them is padded."""
    return len({len(r) for r in rows}) > 1


def _padded(prompts: Sequence[Sequence[int]], pad: int, side: Side = "left") -> tuple[np.ndarray, np.ndarray]:
    longest = max(len(p) for p in prompts)
    ids = np.full((len(prompts), longest), pad, dtype=np.int64)
    mask = np.zeros((len(prompts), longest), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        at = slice(longest - len(prompt), None) if side == "left" else slice(0, len(prompt))
        ids[row, at] = prompt
        mask[row, at] = 1
    return ids, mask


def torch_generate(
    module: Any,
    spec: ModelSpec,
    prompts: Sequence[Sequence[int]],
    steps: int,
    pad: int,
    bits: int | None = None,
    activations: bool = True,
) -> Generation:
    """PyTorch's ``generate()`` of the causal LM inside ``module`` (``module.model``), greedy,
    stopping each row at its config's end-of-sequence token as a generator does; with
    ``bits``, its weights rounded as the int8 or int4 variant rounds them (``rounded``), the
    generation a right quantized graph gives. int4's, simulated to float32 noise, holds as
    its ``room`` how far its activations' near ties move each logit (``INT4_TIES``); without
    ``activations`` (a graph computing MatMulNBits in float), its weights alone, its room how
    far the same generation in float64 is from it (a near tie float32 rounding settles)."""
    from attn_export.runtimes.int8_rounding import INT4_TIES

    model = getattr(module, "model", None)
    if model is None or not callable(getattr(model, "generate", None)):
        raise SpecError(
            f"{spec.name}: --generate compares with PyTorch's generate(), which {type(module).__name__} lacks: "
            "build the model with attn_export.zoo.hf_cache:CausalLMWithCache"
        )
    made = _generated(module, prompts, steps, pad, bits, activations=activations)
    if bits != 4:
        return made
    if activations:
        ties = [_generated(module, prompts, steps, pad, bits, tie) for tie in INT4_TIES]
    else:  # the simulation's own float32 error, against it in float64, as verify's cases take it
        ties = _in_float64(module, prompts, steps, pad)
    return Generation(made.tokens, made.logits, _tie_room(made, ties))


def _in_float64(module: Any, prompts: Sequence[Sequence[int]], steps: int, pad: int) -> list[Generation]:
    """The generation of a float64 copy of ``module`` with int4's weights rounded alone; none
    where the module cannot run in float64."""
    import copy

    try:
        return [_generated(copy.deepcopy(module).double(), prompts, steps, pad, 4, activations=False)]
    except Exception:  # noqa: BLE001 - code that names float32 itself gives no float64 run, and no room
        return []


def _generated(
    module: Any,
    prompts: Sequence[Sequence[int]],
    steps: int,
    pad: int,
    bits: int | None,
    tie: float = 0.0,
    activations: bool = True,
) -> Generation:
    import contextlib

    import torch

    from attn_export.runtimes.int8_rounding import rounded

    ids, mask = _padded(prompts, pad)
    with torch.no_grad(), rounded(module, bits, tie, activations) if bits else contextlib.nullcontext():
        out = module.model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=steps,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[:, ids.shape[1] :].tolist()
    return Generation(tokens, [step.double().numpy() for step in out.logits])


def _tie_room(made: Generation, ties: Sequence[Generation]) -> list[np.ndarray]:
    """Per step and row, ``INT4_TIE_FACTOR`` x the largest |logit - ``made``'s| over the
    ``ties`` runs and the row's logits, for each of them: the flips a graph's own float
    rounding makes are other codes than a nudge flips, and move other logits by as much. A
    row counts while a run has chosen ``made``'s tokens before that step (after, it runs
    another text)."""
    from attn_export.runtimes.int8_rounding import INT4_TIE_FACTOR

    room = [np.zeros_like(step) for step in made.logits]
    for tie in ties:
        for step, want in enumerate(made.logits):
            if step >= len(tie.logits):
                break
            same = [r for r in range(len(made.tokens)) if made.tokens[r][:step] == tie.tokens[r][:step]]
            with np.errstate(invalid="ignore"):
                spread = np.nan_to_num(np.abs(tie.logits[step] - want)).max(axis=-1, keepdims=True)
            room[step][same] = np.maximum(room[step][same], INT4_TIE_FACTOR * spread[same])
    return room


def _played(
    runtime: Runtime,
    spec: ModelSpec,
    prompts: Sequence[Sequence[int]],
    steps: int,
    pad: int,
    forced: Sequence[Sequence[int]] | None = None,
    side: Side = "left",
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Each step's feeds and each row's last logits as the graph in ``runtime`` (activated)
    is run token by token, padded on ``side``: the prompt on an empty cache, then one token a
    step, the greedy one or the ``forced`` row's (PyTorch's tokens, fed back to reach a step).
    Each new token is appended after every row's last position, its mask one; a row padded
    on the right reads its prompt's logits at its last real token, as genai's generator does."""
    cache = cache_of(spec)
    assert cache is not None
    ids, mask = _padded(prompts, pad, side)
    ends = np.array([len(p) - 1 for p in prompts]) if side == "right" else np.full(len(prompts), -1)
    inputs = {t.name: t for t in spec.inputs}
    pasts: dict[str, np.ndarray] = {}
    for past, _ in cache.pairs:
        sizes = {cache.past_dim: 0, **({cache.batch_dim: len(prompts)} if cache.batch_dim else {})}
        shape = [d if isinstance(d, int) else sizes[d] for d in inputs[past].shape]
        pasts[past] = np.zeros(shape, dtype=inputs[past].dtype)
    step_ids = ids
    for step in range(steps):
        positions = np.where(mask == 0, 1, np.cumsum(mask, axis=1) - 1)[:, -step_ids.shape[1] :]
        feeds = {"input_ids": step_ids, MASK: mask, **pasts}
        if POSITIONS in inputs:
            feeds[POSITIONS] = positions
        feeds = {name: np.asarray(value, dtype=inputs[name].dtype) for name, value in feeds.items()}
        out = runtime.run(feeds)
        at = ends if step == 0 else np.full(len(prompts), -1)
        last = np.asarray(out[LOGITS])[np.arange(len(prompts)), at].astype(np.float64)
        yield feeds, last
        chosen = last.argmax(axis=-1) if forced is None else np.array([row[step] for row in forced])
        filled = mask.sum(axis=1) if side == "right" else None
        pasts = {past: _unfilled_zeroed(out[present], filled) for past, present in cache.pairs}
        step_ids = chosen[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((len(prompts), 1), dtype=np.int64)], axis=1)


def _unfilled_zeroed(present: np.ndarray, filled: np.ndarray | None) -> np.ndarray:
    """``present`` as the next step's past: a row padded on the right holds its tokens in its
    first ``filled`` positions, and those after are the pads' or were never written (a
    buffer's NaN, which no input may hold): zero, as nothing the graph may read."""
    if filled is None:
        return present
    after = np.arange(present.shape[2])[None, :] >= filled[:, None]
    return np.where(after[:, None, :, None], np.zeros((), present.dtype), present)


def graph_generate(
    runtime: Runtime, spec: ModelSpec, prompts: Sequence[Sequence[int]], steps: int, pad: int, side: Side = "left"
) -> Generation:
    """The graph in ``runtime`` (activated) run token by token, greedy, padded on ``side``
    (left as PyTorch is fed): the prompt on an empty cache, then one token a step."""
    logits = [last for _, last in _played(runtime, spec, prompts, steps, pad, side=side)]
    tokens = [[int(t) for t in last.argmax(axis=-1)] for last in logits]
    return Generation([list(row) for row in zip(*tokens, strict=True)], logits)


def step_feeds(
    runtime: Runtime,
    spec: ModelSpec,
    prompts: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
    pad: int,
    step: int,
    side: Side = "left",
) -> dict[str, np.ndarray]:
    """The feeds of generation step ``step`` (1 = the prompt) when ``runtime`` (PyTorch's
    module) is fed ``tokens`` (its own generation) before it, padded on ``side``: the step
    localized on PyTorch's inputs, so that only its own divergence shows."""
    feeds, _ = next(itertools.islice(_played(runtime, spec, prompts, step, pad, tokens, side), step - 1, None))
    return feeds


def stacked(generations: Sequence[Generation]) -> Generation:
    """Generations of one row each as the rows of one batch (PyTorch's of each prompt alone);
    a row that ended sooner is NaN past its end (judged no further: it ended)."""
    tokens = [row for g in generations for row in g.tokens]
    steps = max(len(g.logits) for g in generations)
    vocab = generations[0].logits[0].shape[-1]

    def rows(per_step: Sequence[Sequence[np.ndarray]], fill: float) -> list[np.ndarray]:
        blank = np.full((1, vocab), fill)
        return [np.concatenate([g[i] if i < len(g) else blank for g in per_step]) for i in range(steps)]

    rooms = [g.room for g in generations]
    room = None if any(r is None for r in rooms) else rows([r for r in rooms if r is not None], 0.0)
    return Generation(tokens, rows([g.logits for g in generations], np.nan), room)


class Judged(NamedTuple):
    """A generation judged: the largest logit difference at each step judged, one line naming
    the first divergence ('' where none) and its step (from 1; None), and a line for each row
    that parted from PyTorch's tokens on a near tie its tolerance allows (judged no further)."""

    by_step: list[float]
    divergence: str
    step: int | None
    parted: list[str]
    agreed: int | None = None


def judge(expected: Generation, got: Generation, tolerance: Tolerance, eos: frozenset[int] = frozenset()) -> Judged:
    """Step by step, the largest logit difference, and the first step whose tokens differ or
    whose logits break ``tolerance`` (its atol widened by ``atol_rms`` x the step's logits'
    rms and by ``expected``'s room; NaN never agrees): one line naming its row, the two tokens
    and the logit. A row that has ended (PyTorch chose an ``eos`` token) is judged no further,
    as a generator stops it there; a row the graph's runner stopped before that is a
    divergence. A row whose graph picks another token with every logit within the tolerance,
    its own logits favouring that token and PyTorch's two within what each may stray, has met
    a near tie: not a divergence, but the texts part there, so the row is judged no further
    and the tie said (another token picked otherwise is a divergence)."""
    by_step: list[float] = []
    ended: set[int] = set()
    parted: list[str] = []
    agreed: int | None = None
    for step, want in enumerate(expected.logits):
        rows = [r for r in range(len(expected.tokens)) if r not in ended and step < len(expected.tokens[r])]
        if not rows:
            break
        stopped = [r for r in rows if step >= len(got.tokens[r]) or step >= len(got.logits)]
        if stopped:
            row = stopped[0]
            why = f"step {step + 1}, row {row}: the graph's runner stopped after {step} tokens"
            return Judged(by_step, why, step + 1, parted, agreed)
        have = got.logits[step]
        with np.errstate(invalid="ignore"):
            diff = np.abs(want - have)
        by_step.append(float(np.nanmax(diff[rows])) if np.isfinite(diff[rows]).any() else float("nan"))
        # a lossy variant's share of the logits' rms holds what its simulated rounding misses
        shared = tolerance.atol + tolerance.atol_rms * float(np.sqrt(np.nanmean(want[rows] ** 2)))
        room = shared + (expected.room[step] if expected.room is not None else np.zeros_like(want))
        allowed = room + tolerance.rtol * np.abs(want)
        outside = ~(diff <= allowed)
        for row in rows:
            w, h = expected.tokens[row][step], got.tokens[row][step]
            tie = w != h and bool(
                have[row, h] >= have[row, w] and want[row, w] - want[row, h] <= allowed[row, w] + allowed[row, h]
            )
            if outside[row].any() or (w != h and not tie):
                index = int(np.argmax(outside[row])) if outside[row].any() else w
                picks = f"both pick token {w}, but" if w == h else f"PyTorch picks token {w}, the graph {h};"
                why = (
                    f"step {step + 1}, row {row}: {picks} logit {index}: PyTorch {want[row, index]:.6g}, the graph "
                    f"{have[row, index]:.6g} (|diff| {diff[row, index]:.3g}, atol={room[row, index]:.3g} "
                    f"rtol={tolerance.rtol:g})"
                )
                return Judged(by_step, why, step + 1, parted, agreed)
            if tie:
                agreed = step if agreed is None else min(agreed, step)
                parted.append(
                    f"step {step + 1}, row {row}: PyTorch picks token {w}, the graph {h}, on a near tie (PyTorch's "
                    f"logits {want[row, w]:.6g} and {want[row, h]:.6g}, the graph's {have[row, w]:.6g} and "
                    f"{have[row, h]:.6g}, every logit within tolerance): the row is judged no further"
                )
            if w != h or w in eos:
                ended.add(row)
    return Judged(by_step, "", None, parted, agreed)
