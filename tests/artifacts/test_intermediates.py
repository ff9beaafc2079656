"""The recorded intermediates file (``build --record-intermediates``): listed in the manifest
beside the graph and golden file, read back exactly, and refused in one line when it is not
what a build writes."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.intermediates import encode_intermediates, read_intermediates
from attn_export.artifacts.manifest import Manifest, load_manifest
from attn_export.errors import ArtifactError

BUDGET = 1 << 30


def test_the_zoo_build_lists_and_hashes_each_graphs_recording(zoo_dir: Path) -> None:
    manifest = load_manifest(zoo_dir)
    for name, entry in manifest.models.items():
        assert entry.intermediates == f"{name}.intermediates.npz"  # moved to its stable name
        assert sha256_file(zoo_dir / entry.intermediates) == entry.intermediates_sha256
        assert (entry.file, entry.sha256) in entry.files() and len(entry.files()) == 3
    rec = read_intermediates(zoo_dir / "mha.intermediates.npz", manifest.models["mha"].model_spec, BUDGET)
    assert rec.case.label == "distinct" and set(rec.outputs) == {"output"} and rec.outputs["output"] in rec.values
    assert rec.sources["softmax"][2] == "attention_weights = F.softmax(scores, dim=-1)"
    again = encode_intermediates(rec)
    assert again == (zoo_dir / "mha.intermediates.npz").read_bytes()  # deterministic, and read back exactly


def _rewrite(data: bytes, change: Callable[[dict[str, bytes]], None]) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        entries = {i.filename: zf.read(i) for i in zf.infolist()}
    change(entries)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for k, v in entries.items():
            zf.writestr(k, v)
    return buf.getvalue()


def _meta(change: Callable[[dict[str, object]], None]) -> Callable[[dict[str, bytes]], None]:
    def edit(entries: dict[str, bytes]) -> None:
        doc = json.loads(entries["meta.json"])
        change(doc)
        entries["meta.json"] = json.dumps(doc).encode()

    return edit


def _npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, value, allow_pickle=value.dtype.hasobject)
    return buf.getvalue()


HOSTILE: dict[str, tuple[Callable[[dict[str, bytes]], None], str]] = {
    "no meta": (lambda e: e.pop("meta.json"), "not an intermediates file (no meta.json)"),
    "other schema": (_meta(lambda d: d.update(schema="x")), "meta.json: not an attn-export intermediates file"),
    "newer version": (_meta(lambda d: d.update(schema_version=9)), "intermediates file schema_version 9 is not 1"),
    "outputs not strings": (_meta(lambda d: d.update(outputs={"output": 3})), "'outputs' entry 'output' is not 1"),
    "sources not triples": (_meta(lambda d: d["sources"].update(div=["x"])), "'sources' entry 'div' is not 3"),
    "another output": (_meta(lambda d: d.update(outputs={"logits": "div"})), "maps outputs ['logits'], not the"),
    "another case": (_meta(lambda d: d.update(case="min")), "holds cases ['distinct'], not the one meta.json names"),
    "a path as a node": (lambda e: e.update({"values/../x.npy": _npy(np.zeros(1))}), "unexpected entry 'values/../"),
    "pickled values": (lambda e: e.update({"values/div.npy": _npy(np.array([{}], dtype=object))}), "has dtype object"),
    "int4 not an object": (_meta(lambda d: d.update(int4=3)), "meta.json 'int4' is not {'rounded'"),
    "int4 ties wider than the value": (
        _meta(lambda d: d.update(int4={"rounded": 4, "ties": {"div": 1e9}})),
        "'int4' ties of 'div' is 1000000000.0, not a distance its value can move",
    ),
    "int4 ties negative": (_meta(lambda d: d.update(int4={"rounded": 4, "ties": {"div": -1}})), "ties of 'div' is -1"),
    "an input's shape": (
        lambda e: e.update({"distinct/inputs/query.npy": _npy(np.zeros((1, 1, 1), np.float32))}),
        "input 'query' has shape [1, 1, 1]",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_recording_that_is_not_what_a_build_writes_is_refused_in_one_line(
    zoo_dir: Path, tmp_path: Path, case: str
) -> None:
    change, message = HOSTILE[case]
    path = tmp_path / "mha.intermediates.npz"
    path.write_bytes(_rewrite((zoo_dir / "mha.intermediates.npz").read_bytes(), change))
    spec = load_manifest(zoo_dir).models["mha"].model_spec
    with pytest.raises(ArtifactError, match="^" + str(path).replace(".", r"\.")) as caught:
        read_intermediates(path, spec, BUDGET)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_recording_over_the_memory_budget_is_refused_before_it_is_read(zoo_dir: Path) -> None:
    spec = load_manifest(zoo_dir).models["mha"].model_spec
    with pytest.raises(ArtifactError, match="intermediate values declare .* over the memory budget of 1.0 KiB"):
        read_intermediates(zoo_dir / "mha.intermediates.npz", spec, 1024)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"intermediates": ""}, "has an 'intermediates_sha256' but no 'intermediates'"),
        ({"intermediates": "mha.onnx"}, "names intermediates 'mha.onnx', which is neither mha.intermediates.npz"),
        ({"intermediates_sha256": "0" * 12}, "has an invalid 'intermediates_sha256'"),
    ],
)
def test_a_manifest_entry_naming_its_recording_wrongly_is_refused(
    zoo_dir: Path, change: dict[str, str], message: str
) -> None:
    doc = json.loads((zoo_dir / "manifest.json").read_text())
    doc["models"]["mha"].update(change)
    with pytest.raises(ArtifactError, match=message):
        Manifest.from_json(json.dumps(doc))
