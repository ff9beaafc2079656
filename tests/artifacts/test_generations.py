"""Recorded generations: written deterministically, read back as written, and refused in one
line where the file holds anything else (it comes from a build folder, which is data)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from attn_export.artifacts.generations import Recorded, RecordedGenerations, encode_generations, read_generations
from attn_export.errors import ArtifactError
from attn_export.model_spec import load_spec
from tests.conftest import TINY_ZOO

SPEC = load_spec(TINY_ZOO / "llama_causal_lm.toml")
VOCAB = 32


def _recorded() -> RecordedGenerations:
    rng = np.random.default_rng(0)
    logits = [rng.standard_normal((2, VOCAB)) for _ in range(3)]
    logits[2][1] = np.nan  # row 1 ended at step 2
    return RecordedGenerations(
        0,
        frozenset({2}),
        3,
        {"batch-1": [[5, 6, 7]], "padded": [[5, 6, 7], [8, 9]]},
        {
            ("none", "padded", "alone"): Recorded([[4, 4, 9], [3, 2]], logits),
            ("int4", "batch-1", "batch"): Recorded(
                [[1, 1, 1]], [x[:1] for x in logits], [np.full((1, VOCAB), 0.5)] * 3
            ),
        },
    )


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "llama_causal_lm.generate.npz"
    path.write_bytes(data)
    return path


def test_a_file_reads_back_as_written(tmp_path: Path) -> None:
    recorded = _recorded()
    data = encode_generations(recorded)
    assert data == encode_generations(_recorded())  # deterministic bytes
    back = read_generations(_write(tmp_path, data), SPEC, VOCAB, 1 << 30, tmp_path)
    assert (back.pad, back.eos, back.steps, back.prompts) == (0, frozenset({2}), 3, recorded.prompts)
    alone = back.run("none", "padded", "alone", 2)
    assert alone.tokens == [[4, 4], [3, 2]] and len(alone.logits) == 2
    np.testing.assert_array_equal(
        back.runs[("none", "padded", "alone")].logits[2], recorded.runs[("none", "padded", "alone")].logits[2]
    )
    assert alone.room is None  # a run with no near ties to bound records none
    room = back.run("int4", "batch-1", "batch", 2).room
    assert room is not None and len(room) == 2 and (np.asarray(room) == 0.5).all()


def _with(data: bytes, key: str, value: np.ndarray) -> bytes:
    """``data`` with entry ``key`` replaced by (or added as) ``value``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            if info.filename != f"{key}.npy":
                dst.writestr(info, src.read(info))
        npy = io.BytesIO()
        np.lib.format.write_array(npy, value, allow_pickle=False)
        dst.writestr(f"{key}.npy", npy.getvalue())
    return buf.getvalue()


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("meta/code", np.zeros(1), "unexpected entry"),
        ("prompt/padded/1", np.array([8, 99]), "holds an id outside the vocabulary of 32"),
        ("tokens/none/padded/alone", np.zeros((2, 5), np.int64), "do not fit 2 prompts, 3 steps and 32 ids"),
        ("logits/none/padded/alone", np.zeros((3, 2, 31)), "do not fit 2 prompts, 3 steps and 32 ids"),
        ("meta/steps", np.array(10**9), "not a number of steps the spec's ranges hold"),
        ("meta/pad", np.array([0.5]), "is float64 of 1 axes, not what it records"),
        ("room/int4/batch-1/batch", np.full((3, 1, VOCAB), -1.0), "is not a non-negative room of its logits' shape"),
        ("room/int4/batch-1/batch", np.zeros((3, 1, 31)), "is not a non-negative room of its logits' shape"),
        ("room/int4/batch-1/batch", np.full((3, 1, VOCAB), 1e9), "wider than its logits' largest value"),
    ],
)
def test_a_file_holding_anything_else_is_refused(tmp_path: Path, key: str, value: np.ndarray, says: str) -> None:
    path = _write(tmp_path, _with(encode_generations(_recorded()), key, value))
    with pytest.raises(ArtifactError, match=says):
        read_generations(path, SPEC, VOCAB, 1 << 30, tmp_path)


def test_a_file_over_the_memory_budget_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = _write(tmp_path, encode_generations(_recorded()))
    with pytest.raises(ArtifactError, match="over the memory budget of"):
        read_generations(path, SPEC, VOCAB, 100, tmp_path)
