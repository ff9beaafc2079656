"""The architecture holds: imports only point down the stages, every extension point is one
registry that every consumer reads, and graph variants never depend on the order asked."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import click
import onnx
import pytest

from attn_export.build import BuildOptions, build_models
from attn_export.cli import cli
from attn_export.export.variants import make_variant
from attn_export.report import FORMATS
from attn_export.runtimes import PROVIDERS, RUNTIMES
from attn_export.spec import VARIANTS
from tests.conftest import ROOT, write_spec

PACKAGE = ROOT / "attn_export"

#: Each stage may import only from the stages listed for it (and itself).
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "spec": {"base"},
    "zoo": set(),
    "artifacts": {"base", "spec"},
    "runtimes": {"base", "spec", "artifacts"},
    "export": {"base", "spec", "artifacts", "runtimes"},
    "compare": {"base", "spec"},
    "pipelines": {"base", "spec", "zoo", "artifacts", "runtimes", "export", "compare"},
    "report": {"base", "spec", "artifacts", "pipelines"},
    "cli": {"base", "spec", "runtimes", "report", "pipelines", "artifacts"},
    # the package root: its version is base; its API functions load the pipelines lazily
    "root": {"pipelines"},
}
BASE = {"errors", "_deps", "timing", "__init__"}
PIPELINES = {"build", "verify", "bench", "decode", "inspect_model", "fully_masked", "mask_probe", "api"}


def _stage(module: str) -> str:
    top = module.split(".")[1] if "." in module else "__init__"
    if top in BASE:
        return "base"
    if top in ("__main__", "pytest_plugin"):
        return "cli"
    if top in PIPELINES:
        return "pipelines"
    return top


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attn_export"):
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("attn_export")]
    return out


def test_no_import_points_upward() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("attn_export", *path.relative_to(PACKAGE).with_suffix("").parts))
        stage = "root" if path == PACKAGE / "__init__.py" else _stage(module)
        for imported in _imports(path):
            target = _stage(imported)
            if target != stage and target not in ALLOWED[stage]:
                wrong.append(f"{module} ({stage}) imports {imported} ({target})")
    assert not wrong, "\n".join(wrong)


def _choices(command: str, option: str) -> list[str]:
    params = {p.name: p for p in cli.commands[command].params}  # type: ignore[union-attr]
    kind = params[option].type
    assert isinstance(kind, click.Choice)
    return list(kind.choices)


def test_cli_choices_come_from_the_registries() -> None:
    assert _choices("verify", "runtimes") == list(RUNTIMES)
    assert _choices("verify", "providers") == [*PROVIDERS, "all"]
    assert _choices("build", "variants") == list(VARIANTS) == _choices("bench", "variants")
    verify_options = {p.name for p in cli.commands["verify"].params}
    assert {f"report_{name}" for name in FORMATS} <= verify_options


LLAMA = """
module = "tests.user_modules:LlamaStyleAttention"
kwargs = { hidden = 32, heads = 4, kv_heads = 2 }

[[inputs]]
name = "x"
shape = ["batch", "seq", 32]

[[outputs]]
name = "y"
shape = ["batch", "seq", 32]

[dims]
batch = { min = 1, max = 4 }
seq = { min = 1, max = 48 }
"""

ORDER_FREE = ["fp32", "ort-fused", "int8", "ort-optimized"]


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    out = tmp_path_factory.mktemp("llama")
    build_models([write_spec(out / "models", "llama", LLAMA)], BuildOptions(out / "out"))
    return onnx.load(out / "out" / "llama.onnx")


def test_variants_never_modify_their_source_whatever_the_order(llama_export: onnx.ModelProto) -> None:
    source = llama_export.SerializeToString(deterministic=True)
    alone = {v: make_variant(v, llama_export).proto.SerializeToString(deterministic=True) for v in ORDER_FREE}
    for order in itertools.permutations(ORDER_FREE):
        for v in order:
            assert make_variant(v, llama_export).proto.SerializeToString(deterministic=True) == alone[v], order
    assert llama_export.SerializeToString(deterministic=True) == source


def test_build_gives_identical_files_for_every_order_of_variants(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "models", "llama", LLAMA)
    variants = ("ort-fused", "int8", "fp32")
    files: dict[str, bytes] | None = None
    for i, order in enumerate(itertools.permutations(variants)):
        out = tmp_path / f"out{i}"
        summary = build_models([spec], BuildOptions(out, variants=order))
        assert all(r.ok for r in summary.results), [r.error for r in summary.results]
        got = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if not p.name.startswith(".")}
        assert files is None or got == files, order
        files = got
