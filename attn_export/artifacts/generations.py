"""Recorded generations (``<spec>.generate.npz``): PyTorch's greedy generation of a causal
LM's seeded prompts, recorded at build, so ``verify --golden --generate N`` runs on a
deployment box without torch or transformers.

Keys in the .npz: ``meta/pad`` and ``meta/steps`` (int64 scalars: the pad token and how many
new tokens were asked for), ``meta/eos`` (int64, the end-of-sequence tokens),
``prompt/<layout>/<row>`` (int64: a prompt's ids), and for each rounding the graphs
generate by (``none``, ``int8``, ``int4``: a quantized graph generates as the module with
its weights rounded so) and each way of running a layout's prompts (``batch``: one
left-padded batch, as our loop runs them; ``alone``: each prompt by itself, as
onnxruntime-genai's rows are compared), ``tokens/<rounding>/<layout>/<run>`` (int64
``[rows, steps]``, -1 past a row's end) and ``logits/<rounding>/<layout>/<run>`` (float64
``[steps, rows, vocab]``, NaN past a row's end). Read as golden files are: every header is
checked against the spec and the memory budget before any array is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attn_export.artifacts.golden import checked_header, encode_npz, load_entry, open_npz
from attn_export.errors import ArtifactError
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.memory import format_bytes

__all__ = ["LAYOUTS", "ROUNDINGS", "RUNS", "Recorded", "RecordedGenerations", "encode_generations", "read_generations"]

#: ``same-length``: two prompts of one length, for a graph that takes no padding (its mask
#: ``full``), which our loop cannot run on ``padded``.
LAYOUTS = ("batch-1", "padded", "same-length")
#: ``none`` for a float graph, else the quantizing variant whose rounding the module took.
ROUNDINGS = ("none", "int8", "int4")
RUNS = ("batch", "alone")


@dataclass(frozen=True)
class Recorded:
    """One generation: ``tokens[row]`` (each row up to its end) and ``logits[step]`` ``[rows, vocab]``."""

    tokens: list[list[int]]
    logits: list[np.ndarray]
    #: Each step's room beside the tolerance (``Generation.room``), where the run has one.
    room: list[np.ndarray] | None = None


@dataclass
class RecordedGenerations:
    """What build recorded for one causal LM."""

    pad: int
    eos: frozenset[int]
    steps: int
    prompts: dict[str, list[list[int]]]
    runs: dict[tuple[str, str, str], Recorded] = field(default_factory=dict)

    def run(self, rounding: str, layout: str, how: str, steps: int) -> Recorded:
        """The recorded generation cut to its first ``steps`` steps."""
        recorded = self.runs[(rounding, layout, how)]
        room = None if recorded.room is None else recorded.room[:steps]
        return Recorded([row[:steps] for row in recorded.tokens], recorded.logits[:steps], room)


def encode_generations(generations: RecordedGenerations) -> bytes:
    """``generations`` as a deterministic .npz."""
    arrays: dict[str, np.ndarray] = {
        "meta/pad": np.asarray(generations.pad, np.int64),
        "meta/steps": np.asarray(generations.steps, np.int64),
        "meta/eos": np.asarray(sorted(generations.eos), np.int64),
    }
    for layout, rows in generations.prompts.items():
        for i, prompt in enumerate(rows):
            arrays[f"prompt/{layout}/{i}"] = np.asarray(prompt, np.int64)
    for (rounding, layout, how), recorded in generations.runs.items():
        width = max((len(row) for row in recorded.tokens), default=0)
        tokens = np.full((len(recorded.tokens), width), -1, np.int64)
        for i, row in enumerate(recorded.tokens):
            tokens[i, : len(row)] = row
        arrays[f"tokens/{rounding}/{layout}/{how}"] = tokens
        arrays[f"logits/{rounding}/{layout}/{how}"] = np.asarray(recorded.logits, np.float64)
        if recorded.room is not None:
            arrays[f"room/{rounding}/{layout}/{how}"] = np.asarray(recorded.room, np.float64)
    return encode_npz(arrays)


def _known(key: str) -> bool:
    parts = key.split("/")
    if parts[0] == "meta":
        return len(parts) == 2 and parts[1] in ("pad", "steps", "eos")
    if parts[0] == "prompt":
        return len(parts) == 3 and parts[1] in LAYOUTS and parts[2].isdigit() and len(parts[2]) < 3
    return (
        len(parts) == 4 and parts[0] in ("tokens", "logits", "room") and parts[1] in ROUNDINGS
        and parts[2] in LAYOUTS and parts[3] in RUNS
    )  # fmt: skip


def read_generations(path: Path, spec: ModelSpec, vocab: int, budget: int, root: Path) -> RecordedGenerations:
    """The recorded generations of ``spec``'s causal LM (``vocab`` ids) in the build folder
    ``root``, every header checked before an array is loaded; ArtifactError naming what is
    wrong otherwise."""
    seq = max(r.max for r in spec.dims.values())
    with open_npz(path, root, "a recorded generations file") as zf:
        infos = {info.filename.removesuffix(".npy"): info for info in zf.infolist()}
        unknown = sorted(k for k in infos if not _known(k))
        if unknown or len(infos) != len(zf.infolist()):
            raise ArtifactError(f"{path}: unexpected entry {unknown[:1] or 'twice'} in a recorded generations file")
        declared = sum(i.file_size for i in infos.values())
        if declared > budget:
            raise ArtifactError(
                f"{path}: arrays declare {format_bytes(declared)}, over the memory budget of {format_bytes(budget)}"
            )
        headers = {k: checked_header(path, zf, info) for k, info in infos.items()}

        def load(key: str, kind: str, ndim: int) -> np.ndarray:
            if key not in headers:
                raise ArtifactError(f"{path}: no entry '{key}'")
            shape, dtype = headers[key]
            if dtype.kind not in kind or len(shape) != ndim:
                raise ArtifactError(f"{path}: entry '{key}' is {dtype} of {len(shape)} axes, not what it records")
            return load_entry(path, zf, infos[key])

        def ids(values: np.ndarray, key: str, low: int = 0) -> list[int]:
            if values.size and (values.min() < low or values.max() >= vocab):
                raise ArtifactError(f"{path}: entry '{key}' holds an id outside the vocabulary of {vocab}")
            return [int(v) for v in values]

        steps = int(load("meta/steps", "iu", 0))
        if not 0 < steps <= seq:
            raise ArtifactError(f"{path}: meta/steps {steps} is not a number of steps the spec's ranges hold")
        recorded = RecordedGenerations(
            int(ids(load("meta/pad", "iu", 0).reshape(1), "meta/pad")[0]),
            frozenset(ids(load("meta/eos", "iu", 1), "meta/eos")),
            steps,
            {},
        )
        numbered: dict[str, dict[int, list[int]]] = {}
        for key in sorted(k for k in infos if k.startswith("prompt/")):
            layout, row = key.split("/")[1:]
            prompt = load(key, "iu", 1)
            if not 0 < prompt.size <= seq:
                raise ArtifactError(f"{path}: entry '{key}' is a prompt of {prompt.size} tokens")
            numbered.setdefault(layout, {})[int(row)] = ids(prompt, key)
        for layout, by_row in numbered.items():
            if sorted(by_row) != list(range(len(by_row))):
                raise ArtifactError(f"{path}: the prompts of {layout} are not numbered 0 to {len(by_row) - 1}")
            recorded.prompts[layout] = [by_row[i] for i in range(len(by_row))]
        for key in sorted(k for k in infos if k.startswith("tokens/")):
            _, rounding, layout, how = key.split("/")
            rows = len(recorded.prompts.get(layout, []))
            tokens, logits = load(key, "iu", 2), load(f"logits/{rounding}/{layout}/{how}", "f", 3)
            if tokens.shape[0] != rows or tokens.shape[1] > steps or logits.shape != (tokens.shape[1], rows, vocab):
                raise ArtifactError(
                    f"{path}: {key} {list(tokens.shape)} and its logits {list(logits.shape)} do not fit "
                    f"{rows} prompts, {steps} steps and {vocab} ids"
                )
            kept = [ids(row[row >= 0], key) for row in tokens]
            room = f"room/{rounding}/{layout}/{how}"
            spread = load(room, "f", 3) if room in infos else None
            if spread is not None and (spread.shape != logits.shape or not (spread >= 0).all()):
                raise ArtifactError(f"{path}: {room} is not a non-negative room of its logits' shape")
            largest = np.abs(np.where(np.isfinite(logits), logits, 0.0)).max(axis=(1, 2), keepdims=True, initial=0.0)
            if spread is not None and (spread > largest).any():  # data: a room that wide would pass any logits
                raise ArtifactError(f"{path}: {room} is wider than its logits' largest value, which no near tie moves")
            recorded.runs[(rounding, layout, how)] = Recorded(
                kept, list(logits), None if spread is None else list(spread)
            )
    if not recorded.runs:
        raise ArtifactError(f"{path}: records no generation")
    return recorded
