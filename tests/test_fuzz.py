"""Fuzzing: mutated model and manifest files never make inspect or verify crash.

The default run feeds 1,000 mutated files (seeded); set ATTN_EXPORT_FUZZ=N for a longer one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from attn_export.artifacts.files import sha256_file
from attn_export.cli import cli

COUNT = int(os.environ.get("ATTN_EXPORT_FUZZ", "1000"))
DEADLINE_S = max(120.0, COUNT * 0.5)


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


_VALUES = [None, 0, -1, 1e308, "", "../x", "/etc/passwd", [], {}, True, "mha.onnx", 2**63, "NaN"]


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
        parent[key] = rng.choice(_VALUES)
    return doc


def _check(result) -> None:
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output


def test_mutated_models_and_manifests_never_crash(zoo_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "zoo"
    folder.mkdir()
    for name in ("sdpa.onnx", "sdpa.golden.npz", "manifest.json"):
        shutil.copy(zoo_dir / name, folder / name)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["models"] = {"sdpa": manifest["models"]["sdpa"]}
    manifest_text = json.dumps(manifest)
    model = (zoo_dir / "sdpa.onnx").read_bytes()
    runner = CliRunner()
    rng = random.Random(20261130)
    started = time.monotonic()
    exit_codes = {0: 0, 1: 0, 2: 0}
    for i in range(COUNT):
        if time.monotonic() - started > DEADLINE_S:
            pytest.fail(f"fuzzing took longer than {DEADLINE_S:.0f} s after {i} files")
        if i % 2 == 0:  # a mutated model, its manifest hash fixed up so verify reaches the graph
            (folder / "sdpa.onnx").write_bytes(_mutate_bytes(model, rng))
            doc = json.loads(manifest_text)
            doc["models"]["sdpa"]["sha256"] = sha256_file(folder / "sdpa.onnx")
            (folder / "manifest.json").write_text(json.dumps(doc))
            result = runner.invoke(cli, ["inspect", str(folder / "sdpa.onnx")])
            _check(result)
        else:  # a mutated manifest (structurally or byte-wise), with the original model
            (folder / "sdpa.onnx").write_bytes(model)
            if rng.random() < 0.7:
                text = json.dumps(_mutate_json(json.loads(manifest_text), rng))
            else:
                text = _mutate_bytes(manifest_text.encode(), rng).decode("utf-8", "replace")
            (folder / "manifest.json").write_text(text)
        result = runner.invoke(cli, ["verify", str(folder), "--golden", "--no-latency"])
        _check(result)
        exit_codes[result.exit_code] += 1
    print(f"fuzz: {COUNT} files, verify exit codes {exit_codes}")
    assert exit_codes[2] > COUNT // 4  # most mutations are bad input...
    assert exit_codes[0] > 0  # ...but some (e.g. an unused field) still verify
