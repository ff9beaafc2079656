"""Fuzzing: mutated model, manifest and golden files never make inspect, verify, the Python
API or the pytest plugin crash.

Mutations are byte-wise and structural: manifests nested 200,000 deep or holding huge
values, golden entries whose .npy headers declare other shapes, dtypes or sizes, a zip bomb;
the API also gets out-of-range arguments, the plugin out-of-range options and mutated
checkout specs. The default run feeds 100 mutated files to the CLI and 30 to the API (seeded);
the slow run 1,000, 300, and 60 to the plugin (a plugin run is a pytest process)
(ATTN_EXPORT_FUZZ=N: N, 3N/10, 6N/100).
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from attn_export import api
from attn_export.artifacts.files import sha256_file
from attn_export.cli import cli
from attn_export.errors import AttnExportError
from tests.conftest import TINY_ZOO

#: Files fed by default, and by the slow run.
SAMPLE, WHOLE = 50, int(os.environ.get("ATTN_EXPORT_FUZZ", "1000"))


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


@dataclass(frozen=True)
class _Sdpa:
    """The tiny zoo's sdpa, the files each mutation starts from."""

    model: bytes
    golden: bytes
    manifest: str
    arrays: dict[str, np.ndarray]
    bomb: bytes


def _sdpa(zoo_dir: Path) -> _Sdpa:
    manifest = json.loads((zoo_dir / "manifest.json").read_text())
    manifest["models"] = {"sdpa": manifest["models"]["sdpa"]}
    with np.load(zoo_dir / "sdpa.golden.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    model, golden = (zoo_dir / "sdpa.onnx").read_bytes(), (zoo_dir / "sdpa.golden.npz").read_bytes()
    return _Sdpa(model, golden, json.dumps(manifest), arrays, _zip_bomb(arrays))


def _mutated_folder(folder: Path, sdpa: _Sdpa, i: int, rng: random.Random) -> None:
    """Write sdpa's build folder with one file mutated, by ``i``: the model (``i % 3 == 0``)
    or the golden file (1), each with its manifest hash fixed up so verify reads it, or the
    manifest (2), structurally or byte-wise."""
    folder.mkdir(exist_ok=True)
    (folder / "sdpa.onnx").write_bytes(sdpa.model)
    (folder / "sdpa.golden.npz").write_bytes(sdpa.golden)
    doc = json.loads(sdpa.manifest)
    if i % 3 == 0:
        (folder / "sdpa.onnx").write_bytes(_mutate_bytes(sdpa.model, rng))
        doc["models"]["sdpa"]["sha256"] = sha256_file(folder / "sdpa.onnx")
        (folder / "manifest.json").write_text(json.dumps(doc))
    elif i % 3 == 1:
        (folder / "sdpa.golden.npz").write_bytes(_mutate_golden(sdpa.arrays, sdpa.bomb, rng))
        doc["models"]["sdpa"]["golden_sha256"] = sha256_file(folder / "sdpa.golden.npz")
        (folder / "manifest.json").write_text(json.dumps(doc))
    elif rng.random() < 0.7:
        (folder / "manifest.json").write_text(_manifest_text(_mutate_json(doc, rng), rng))
    else:
        (folder / "manifest.json").write_text(_mutate_bytes(sdpa.manifest.encode(), rng).decode("utf-8", "replace"))


@pytest.mark.parametrize("count", [SAMPLE, pytest.param(WHOLE, marks=pytest.mark.slow)])
def test_mutated_models_manifests_and_golden_files_never_crash(zoo_dir: Path, tmp_path: Path, count: int) -> None:
    deadline_s = max(120.0, count * 0.5)
    folder = tmp_path / "zoo"
    sdpa = _sdpa(zoo_dir)
    runner = CliRunner()
    rng = random.Random(20261130)
    started = time.monotonic()
    exit_codes = {0: 0, 1: 0, 2: 0}
    for i in range(count):
        if time.monotonic() - started > deadline_s:
            pytest.fail(f"fuzzing took longer than {deadline_s:.0f} s after {i} files")
        _mutated_folder(folder, sdpa, i, rng)
        if i % 3 == 0:  # a mutated model
            _check(runner.invoke(cli, ["inspect", str(folder / "sdpa.onnx")]))
        result = runner.invoke(cli, ["verify", str(folder), "--golden", "--no-latency"])
        _check(result)
        exit_codes[result.exit_code] += 1
    print(f"fuzz: {count} files, verify exit codes {exit_codes}")
    assert exit_codes[2] > count // 4  # most mutations are bad input...
    assert exit_codes[0] > 0  # ...but some (e.g. an unused field) still verify


def _mutate_spec(text: str, rng: random.Random) -> str:
    """A spec's TOML with one number replaced by another value, of any type."""
    at = rng.choice(list(re.finditer(r"\b\d+(?:\.\d+)?(?:e-?\d+)?\b", text)))
    value = rng.choice(["-1", "0", "2147483648", "1e400", "nan", '"x"', "[]", "{}"])
    return text[: at.start()] + value + text[at.end() :]


#: Options of ``api.build`` of the right type and out of range: each call has one.
_BUILD_OPTIONS: list[dict[str, Any]] = [
    {"variants": ["nope"]},
    {"variants": ["fp32", "int8", "nope"]},
    {"opset": -1},
    {"opset": 2**70},
    {"exporter": ""},
    {"provider": "nope"},
    {"out": "/dev/null"},
]
#: Arguments of ``api.verify`` of the right type and out of range, and some in range.
_API_ARGUMENTS: dict[str, list[Any]] = {
    "golden": [False],
    "shapes": [[{"batch": -1, "seq": 1, "kv_seq": 1}], [{"nope": 3}], [{"batch": 2**70, "seq": 1, "kv_seq": 1}], [{}]],
    "seed": [-1, 2**70, 7],
    "n_random": [-1, 2**40, 0],
    "atol": [float("nan"), -1.0, float("inf"), 1.0],
    "rtol": [float("nan"), -1.0],
    "providers": [["nope"], [], ["cuda"], ["cpu", "cpu"]],
    "runtimes": [["nope"], [], ["onnx-reference"]],
    "models": ["nowhere", "sdpa.onnx"],
}


@pytest.mark.parametrize("count", [SAMPLE * 3 // 10, pytest.param(WHOLE * 3 // 10, marks=pytest.mark.slow)])
def test_mutated_folders_and_bad_arguments_never_crash_the_api(zoo_dir: Path, tmp_path: Path, count: int) -> None:
    """``api.verify`` returns a report or raises one of the project's errors, in one line;
    so does ``api.build`` of a mutated spec with an option out of range (refused before
    any export)."""
    folder = tmp_path / "zoo"
    sdpa = _sdpa(zoo_dir)
    spec_text = (TINY_ZOO / "sdpa.toml").read_text()
    rng = random.Random(20261201)
    outcomes: dict[str, int] = {}
    for i in range(count):
        (tmp_path / "sdpa.toml").write_text(_mutate_spec(spec_text, rng))
        with pytest.raises(AttnExportError) as refused:
            api.build(tmp_path / "sdpa.toml", **{"out": tmp_path / "out", **rng.choice(_BUILD_OPTIONS)})
        assert "\n" not in str(refused.value), str(refused.value)
        _mutated_folder(folder, sdpa, i, rng)
        kwargs: dict[str, Any] = {"golden": True, "models": str(TINY_ZOO)}
        for key in rng.sample(sorted(_API_ARGUMENTS), rng.choice([0, 0, 1, 2])):
            kwargs[key] = rng.choice(_API_ARGUMENTS[key])
        if kwargs["models"] == "sdpa.onnx":
            kwargs["models"] = str(folder / "sdpa.onnx")
        try:
            outcome = "passed" if api.verify(folder, **kwargs).passed else "failed"
        except AttnExportError as e:
            assert str(e) and "\n" not in str(e), (i, kwargs, str(e))
            outcome = type(e).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"fuzz: {count} calls, outcomes {outcomes}")
    assert outcomes.get("passed", 0) > 0 and len(outcomes) > 3


#: Runs pytest with the plugin once per argument list of argv[1] (JSON), in this one process
#: (one import of torch), and prints each run's exit code and output as JSON.
_PLUGIN_RUNS = """
import contextlib, io, json, sys

import pytest

results = []
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main([*args, "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-s"])
    results.append([int(code), out.getvalue()])
print(json.dumps(results))
"""
#: Plugin options out of range, and some in range.
_PLUGIN_OPTIONS = [
    ["--attn-export-seed", "-1"],
    ["--attn-export-seed", str(2**70)],
    ["--attn-export-max-memory", ""],
    ["--attn-export-max-memory", "1"],
    ["--attn-export-max-memory", "8GiB"],
    ["--attn-export-provider", "nope"],
    ["--attn-export-models", "nowhere"],
]
#: What a traceback leaves in pytest's output: its header, an internal error, a frame.
_TRACEBACK = re.compile(r"Traceback|INTERNALERROR|\.py:\d+: |^E {3}", re.M)


@pytest.mark.parametrize("count", [pytest.param(WHOLE * 6 // 100, marks=pytest.mark.slow)])
def test_mutated_folders_and_specs_never_crash_the_plugin(zoo_dir: Path, tmp_path: Path, count: int) -> None:
    """Every run ends in passed or failed tests, no tests or a usage error, never an internal
    error, a collection error or a traceback; the checkout's spec is mutated too, a value at
    a time (a spec is the checkout's: trusted, and still never a crash)."""
    sdpa = _sdpa(zoo_dir)
    spec_text = (TINY_ZOO / "sdpa.toml").read_text()
    rng = random.Random(20261202)
    runs = []
    for i in range(count):
        folder, models = tmp_path / f"build{i}", tmp_path / f"models{i}"
        _mutated_folder(folder, sdpa, i, rng)
        models.mkdir()
        (models / "sdpa.toml").write_text(_mutate_spec(spec_text, rng) if rng.random() < 0.5 else spec_text)
        runs.append(
            ["--attn-export", str(folder), "--attn-export-models", str(models), *rng.choice([[], *_PLUGIN_OPTIONS])]
        )
    done = subprocess.run(
        [sys.executable, "-c", _PLUGIN_RUNS, json.dumps(runs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    codes: dict[int, int] = {}
    for args, (code, output) in zip(runs, json.loads(done.stdout.splitlines()[-1]), strict=True):
        assert code in (0, 1, 4, 5), (args, output)
        assert not _TRACEBACK.search(output), (args, output)
        codes[code] = codes.get(code, 0) + 1
    print(f"fuzz: {count} plugin runs, exit codes {codes}")
