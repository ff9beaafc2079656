"""localize --golden: on a box without torch, from the intermediates a build recorded."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest

from tests.conftest import TINY_ZOO, Built, copy_build, plant, scale_initializer, shared_build, unchanged

ZOO_CODE = Path(__file__).resolve().parents[2] / "attn_export" / "zoo"
#: The CLI where torch cannot be imported, as on a deploy box.
NO_TORCH = "import sys; sys.modules['torch'] = None; from attn_export.cli import main; main(sys.argv[1:])"
SPEC = TINY_ZOO / "mha.toml"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The tiny zoo's ``mha`` alone, built with its intermediates recorded (4 s), never changed."""
    built = shared_build(tmp_path_factory, "localize-golden-mha", [SPEC], record_intermediates=True)
    assert built.errors == {"mha": None}, built.errors
    with unchanged(built.out):
        yield built


def test_a_regions_line_on_a_box_without_torch_is_the_one_recorded(recorded: Built, tmp_path: Path) -> None:
    """Read without torch, the graph's own stack trace of a Linear ends in torch's F.linear:
    the line the build recorded, read with torch, is the one that called the layer."""
    built = copy_build(recorded, tmp_path)
    proto = onnx.load(built.out / "mha.onnx")
    scale_initializer(proto, "val_3", 1.25)  # the key projection's weight
    plant(built.out, "mha", proto)
    run = [sys.executable, "-c", NO_TORCH, "localize", str(built.out), "mha", "--golden"]
    found = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)  # no checkout here
    assert found.returncode == 1, found.stderr
    blamed = "DIVERGES first at ONNX node_linear_1 (+1 nodes) [MatMul+Add] from FX node linear_1 (aten.linear.default) "
    assert f"{blamed}in k_linear at {ZOO_CODE / 'seed.py'}:69 `k = self.k_linear(keys)`\n" in found.stdout
