"""Shared fixtures: the zoo built once per session, and helpers to write small specs."""

from __future__ import annotations

import importlib.util
import shutil
import textwrap
from pathlib import Path

import pytest

from attn_export.pipelines.build import BuildOptions, build_models
from attn_export.pipelines.verify import VerifyOptions, case_plan
from attn_export.spec import load_spec, spec_paths

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "models"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
#: For tests of Hugging Face layers: CI installs the test extra, which has transformers.
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="needs transformers (pip install -e '.[export,hf,test]')"
)


def _needs_hf(path: Path) -> bool:
    spec = load_spec(path)
    return any(t.startswith("transformers") for t in (spec.module, (spec.config or {}).get("class", "")))


#: The zoo's spec files this environment can build (the Hugging Face ones need transformers).
ZOO_SPECS = [p for p in spec_paths(ZOO) if HAS_TRANSFORMERS or not _needs_hf(p)]
#: Cases a default verify of that zoo runs: every model's sweep, named mask cases included.
ZOO_CASES = sum(len(case_plan(load_spec(p), VerifyOptions())) for p in ZOO_SPECS)


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in zoo, built once; tests that modify it take a copy (``zoo_copy``)."""
    out = tmp_path_factory.mktemp("zoo")
    summary = build_models(ZOO_SPECS, BuildOptions(out))
    failed = [r.error for r in summary.results if not r.ok]
    assert not failed, failed
    return out


@pytest.fixture
def zoo_copy(zoo_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "zoo"
    shutil.copytree(zoo_dir, dest)
    return dest


def write_spec(folder: Path, name: str, body: str) -> Path:
    """Write ``folder/name.toml`` from an indented TOML string."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(textwrap.dedent(body).lstrip())
    return path


TINY_MHA = """
module = "attn_export.zoo.seed:MultiHeadAttention"
kwargs = { hidden_dim = 16, num_heads = 2 }
exporter = "{exporter}"

[[inputs]]
name = "query"
shape = ["batch", "seq", 16]
[[inputs]]
name = "keys"
shape = ["batch", "kv_seq", 16]
[[inputs]]
name = "values"
shape = ["batch", "kv_seq", 16]

[[outputs]]
name = "output"
shape = ["batch", "seq", 16]

[dims]
batch = { min = 1, max = 4 }
seq = { min = 1, max = 24 }
kv_seq = { min = 1, max = 40 }
"""


def tiny_spec(folder: Path, name: str = "tiny", exporter: str = "dynamo", body: str = TINY_MHA) -> Path:
    """A small cross-attention MHA spec; fast to export."""
    return write_spec(folder, name, body.replace("{exporter}", exporter))


def plant(
    out_dir: Path, name: str, proto_or_bytes: object, module: str | None = None, models: Path | None = None
) -> None:
    """Replace a built model's graph and fix up its manifest hash, as a careless edit would;
    ``module`` also swaps the PyTorch original in the checkout's spec (``models``) and
    records it in the manifest, as a script that exported the module without comparing
    the two would."""
    import json

    import onnx

    from attn_export.artifacts.files import sha256_file
    from attn_export.exporter.source import module_sources
    from attn_export.spec import load_spec

    path = out_dir / f"{name}.onnx"
    if isinstance(proto_or_bytes, onnx.ModelProto):
        onnx.save(proto_or_bytes, path)
    else:
        path.write_bytes(proto_or_bytes)  # type: ignore[arg-type]
    manifest_path = out_dir / "manifest.json"
    doc = json.loads(manifest_path.read_text())
    entry = doc["models"][name]
    entry["sha256"] = sha256_file(path)
    if module is not None:
        assert models is not None
        spec_path = models / f"{entry['spec']['name']}.toml"
        text = spec_path.read_text()
        old = entry["spec"]["module"]
        spec_path.write_text(text.replace(f'module = "{old}"', f'module = "{module}"'))
        spec = load_spec(spec_path)
        entry.update(spec=spec.to_dict(), spec_hash=spec.content_hash(), sources=module_sources(spec))
    manifest_path.write_text(json.dumps(doc, indent=2))


def node(proto: object, op_type: str) -> object:
    """The first node of a type in a graph."""
    return next(n for n in proto.graph.node if n.op_type == op_type)  # type: ignore[attr-defined]


def set_initializer(proto: object, name: str, value: float) -> None:
    """Overwrite a scalar initializer in place."""
    import numpy as np
    from onnx import numpy_helper

    for i, init in enumerate(proto.graph.initializer):  # type: ignore[attr-defined]
        if init.name == name:
            dtype = numpy_helper.to_array(init).dtype
            proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.array(value, dtype=dtype), name))  # type: ignore[attr-defined]
            return
    raise KeyError(name)
