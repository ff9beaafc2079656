"""Fuzzing: mutated model, manifest and golden files never make inspect or verify crash.

Mutations are byte-wise and structural: manifests nested 200,000 deep or holding huge
values, golden entries whose .npy headers declare other shapes, dtypes or sizes, a zip bomb.
The default run feeds 100 mutated files (seeded), the slow run 1,000 (ATTN_EXPORT_FUZZ=N: N).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from attn_export.artifacts.files import sha256_file
from attn_export.cli import cli

#: Files fed by default, and by the slow run.
SAMPLE, WHOLE = 100, int(os.environ.get("ATTN_EXPORT_FUZZ", "1000"))


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0 and buf:  # truncate
        return bytes(buf[: rng.randrange(len(buf))])
    if kind == 1:  # flip bytes
        for _ in range(rng.randint(1, 16)):
            if buf:
                buf[rng.randrange(len(buf))] = rng.randrange(256)
        return bytes(buf)
    if kind == 2:  # insert random bytes
        at = rng.randrange(len(buf) + 1)
        return bytes(buf[:at]) + rng.randbytes(rng.randint(1, 64)) + bytes(buf[at:])
    if kind == 3 and len(buf) > 8:  # duplicate a slice
        a = rng.randrange(len(buf) - 4)
        b = rng.randrange(a + 1, len(buf))
        return bytes(buf[:b]) + bytes(buf[a:b]) + bytes(buf[b:])
    return rng.randbytes(rng.randint(0, 256))


_VALUES = [None, 0, -1, 1e308, "", "../x", "/etc/passwd", [], {}, True, "mha.onnx", 2**63, "NaN", 10**400, "x" * 10**5]
_DEEP = "__deep__"


def _mutate_json(doc: object, rng: random.Random) -> object:
    """Replace, delete or retype one value somewhere in the document."""
    path = []
    node = doc
    while isinstance(node, dict | list) and node and rng.random() < 0.8:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return rng.choice(_VALUES)
    parent, key = path[-1]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
    else:
        parent[key] = rng.choice([*_VALUES, _DEEP])
    return doc


def _manifest_text(doc: object, rng: random.Random) -> str:
    """The document as JSON, with any ``_DEEP`` value nested up to 200,000 levels deep."""
    depth = rng.choice([50, 900, 5_000, 200_000])
    return json.dumps(doc).replace(json.dumps(_DEEP), "[" * depth + "]" * depth)


def _npy(array: np.ndarray, shape: tuple[int, ...] | None = None, descr: str | None = None) -> bytes:
    """An .npy entry whose header may declare another shape or dtype than the data it holds."""
    header = {"descr": descr or np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {**header, "shape": array.shape if shape is None else shape})
    return buf.getvalue() + array.tobytes()


_SHAPES = [(2**40,), (2**31, 2**31), (0,), (1,) * 40, (3, 5), (2**62, 4)]
_DESCRS = ["|O", "<c8", ">f8", "<U4", "|V8", "<i8", "|b1"]


def _mutate_golden(arrays: dict[str, np.ndarray], bomb: bytes, rng: random.Random) -> bytes:
    """A golden .npz with one entry reshaped, retyped, resized, dropped, duplicated or renamed;
    or the zip bomb; or byte-level noise."""
    kind = rng.randrange(7)
    if kind == 0:
        return bomb
    entries = {f"{k}.npy": _npy(a) for k, a in arrays.items()}
    key = rng.choice(sorted(entries))
    array = arrays[key.removesuffix(".npy")]
    if kind == 1:
        entries[key] = _npy(array, shape=rng.choice(_SHAPES))
    elif kind == 2:
        entries[key] = _npy(array, descr=rng.choice(_DESCRS))
    elif kind == 3:
        entries[key] = _npy(np.asarray(rng.choice([2**62, -1, 0, 10**6, 300]), np.int64))
    elif kind == 4:
        del entries[key]
    elif kind == 5:
        entries[rng.choice([key.replace("inputs", "outputs"), key + ".npy", "a/b/c/d.npy", "min/sizes/extra.npy"])] = (
            entries[key]
        )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return _mutate_bytes(buf.getvalue(), rng) if kind == 6 else buf.getvalue()


def _zip_bomb(arrays: dict[str, np.ndarray]) -> bytes:
    """The golden file with one input replaced by 256 MiB of zeros: about 256 KiB on disk."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for key, array in arrays.items():
            if key != "min/inputs/q":
                zf.writestr(f"{key}.npy", _npy(array))
        with zf.open("min/inputs/q.npy", "w", force_zip64=True) as f:
            f.write(_npy(np.zeros(0, np.float32), shape=(64 << 20,)))
            for _ in range(256):
                f.write(bytes(1 << 20))
    return buf.getvalue()


def _check(result) -> None:
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


@pytest.mark.parametrize("count", [SAMPLE, pytest.param(WHOLE, marks=pytest.mark.slow)])
def test_mutated_models_manifests_and_golden_files_never_crash(zoo_dir: Path, tmp_path: Path, count: int) -> None:
    deadline_s = max(120.0, count * 0.5)
    folder = tmp_path / "zoo"
    folder.mkdir()
    for name in ("sdpa.onnx", "sdpa.golden.npz", "manifest.json"):
        shutil.copy(zoo_dir / name, folder / name)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["models"] = {"sdpa": manifest["models"]["sdpa"]}
    manifest_text = json.dumps(manifest)
    model = (zoo_dir / "sdpa.onnx").read_bytes()
    golden = (zoo_dir / "sdpa.golden.npz").read_bytes()
    with np.load(zoo_dir / "sdpa.golden.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    bomb = _zip_bomb(arrays)
    runner = CliRunner()
    rng = random.Random(20261130)
    started = time.monotonic()
    exit_codes = {0: 0, 1: 0, 2: 0}
    for i in range(count):
        if time.monotonic() - started > deadline_s:
            pytest.fail(f"fuzzing took longer than {deadline_s:.0f} s after {i} files")
        (folder / "sdpa.onnx").write_bytes(model)
        (folder / "sdpa.golden.npz").write_bytes(golden)
        doc = json.loads(manifest_text)
        if i % 3 == 0:  # a mutated model, its manifest hash fixed up so verify reaches the graph
            (folder / "sdpa.onnx").write_bytes(_mutate_bytes(model, rng))
            doc["models"]["sdpa"]["sha256"] = sha256_file(folder / "sdpa.onnx")
            (folder / "manifest.json").write_text(json.dumps(doc))
            result = runner.invoke(cli, ["inspect", str(folder / "sdpa.onnx")])
            _check(result)
        elif i % 3 == 1:  # a mutated golden file, its hash fixed up so verify reads it
            (folder / "sdpa.golden.npz").write_bytes(_mutate_golden(arrays, bomb, rng))
            doc["models"]["sdpa"]["golden_sha256"] = sha256_file(folder / "sdpa.golden.npz")
            (folder / "manifest.json").write_text(json.dumps(doc))
        elif rng.random() < 0.7:  # a manifest mutated structurally...
            (folder / "manifest.json").write_text(_manifest_text(_mutate_json(doc, rng), rng))
        else:  # ...or byte-wise
            (folder / "manifest.json").write_text(_mutate_bytes(manifest_text.encode(), rng).decode("utf-8", "replace"))
        result = runner.invoke(cli, ["verify", str(folder), "--golden", "--no-latency"])
        _check(result)
        exit_codes[result.exit_code] += 1
    print(f"fuzz: {count} files, verify exit codes {exit_codes}")
    assert exit_codes[2] > count // 4  # most mutations are bad input...
    assert exit_codes[0] > 0  # ...but some (e.g. an unused field) still verify
