"""Shared fixtures: the zoo built once per session, and helpers to write small specs."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from attn_export.build import BuildOptions, build_models
from attn_export.spec import spec_paths

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "models"


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole built-in zoo, built once; tests that modify it take a copy (``zoo_copy``)."""
    out = tmp_path_factory.mktemp("zoo")
    summary = build_models(spec_paths(ZOO), BuildOptions(out))
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
module = "attn_export.reference.seed:MultiHeadAttention"
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
