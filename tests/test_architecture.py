"""The architecture holds: imports only point down the stages, every extension point is one
registry that every consumer reads, and graph variants never depend on the order asked."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Sequence
from pathlib import Path

import click
import onnx
import pytest

from attn_export.cli import cli
from attn_export.exporter.variants import make_variant
from attn_export.model_spec import VARIANTS
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.report import FORMATS
from attn_export.runtimes import PROVIDERS, RUNTIMES
from tests.conftest import ROOT, write_spec

PACKAGE = ROOT / "attn_export"

#: The stages in the order data flows through them: a module may import its own stage and
#: the stages before it, never one after. Every folder is a stage; at the top sit only the
#: bases and the faces.
STAGES = (
    "base",
    "model_spec",
    "zoo",
    "artifacts",
    "runtimes",
    "exporter",
    "compare",
    "checks",
    "executors",
    "pipelines",
    "report",
    "faces",
)
BASES = {"errors", "_deps"}
FACES = {"cli", "api", "pytest_plugin", "github_action", "__main__"}
#: The one upward import: the package root loads the Python API lazily, on first use.
LAZY_API = ("attn_export", "attn_export.api")


def _stage(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in BASES:
        return "base"
    if parts[1] in FACES:
        return "faces"
    assert parts[1] in STAGES, f"{module}: neither a stage folder, a base nor a face"
    return parts[1]


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("attn_export", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attn_export"):
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("attn_export")]
    return out


def test_the_top_of_the_package_holds_only_stages_bases_and_faces() -> None:
    """A face may be a package of its own (``cli/``, a module per command)."""
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} - FACES
    assert top <= BASES | FACES, top - BASES - FACES
    assert folders == set(STAGES) - {"base", "faces"}, folders ^ (set(STAGES) - {"base", "faces"})


def test_no_import_points_upward() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        stage = STAGES.index(_stage(module))
        for imported in _imports(path):
            if (module, imported) == LAZY_API:
                continue
            target = _stage(imported)
            if STAGES.index(target) > stage:
                wrong.append(f"{module} ({STAGES[stage]}) imports {imported} ({target})")
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_circle() -> None:
    graph: dict[str, set[str]] = {_module(p): set(_imports(p)) - {_module(p)} for p in PACKAGE.rglob("*.py")}
    graph["attn_export"].discard(LAZY_API[1])
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done or module not in graph:
            return []
        for imported in sorted(graph[module]):
            circle = visit(imported, (*path, module))
            if circle:
                return circle
        done.add(module)
        return []

    for module in sorted(graph):
        circle = visit(module, ())
        assert not circle, " -> ".join(circle)


#: What only ``checks/spec_learning`` may call: a spec is learned from its module one way.
LEARNING = {"with_lookup_ranges", "check_masks"}


def test_a_spec_is_learned_from_its_module_in_one_room() -> None:
    home = {"attn_export.checks.spec_learning", "attn_export.checks.mask_probe", "attn_export.exporter.index_inputs"}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _module(path) in home:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attn_export"):
                wrong += [f"{_module(path)} imports {a.name}" for a in node.names if a.name in LEARNING]
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
#: The variants whose build must not depend on the order asked, in the order the shared build asks.
BUILT = ("ort-fused", "int8", "fp32")


@pytest.fixture(scope="module")
def llama_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """The spec built once with ``BUILT`` in that order: the spec, and the files the build wrote."""
    root = tmp_path_factory.mktemp("llama")
    spec = write_spec(root / "models", "llama", LLAMA)
    return spec, _built(spec, root / "out", BUILT)


def _built(spec: Path, out: Path, variants: Sequence[str]) -> dict[str, bytes]:
    summary = build_models([spec], BuildOptions(out, variants=tuple(variants)))
    assert all(r.ok for r in summary.results), [r.error for r in summary.results]
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if not p.name.startswith(".")}


@pytest.fixture(scope="module")
def llama_export(llama_build: tuple[Path, dict[str, bytes]]) -> onnx.ModelProto:
    return onnx.load_from_string(llama_build[1]["llama.onnx"])


def _orders(variants: Sequence[str], every: bool) -> list[tuple[str, ...]]:
    """Every other order of the variants, or a sample: their reverse."""
    return (
        [o for o in itertools.permutations(variants) if o != tuple(variants)] if every else [tuple(reversed(variants))]
    )


#: The reverse order by default, every order in the slow run.
ORDERS = [pytest.param(False, id="reversed"), pytest.param(True, id="every", marks=pytest.mark.slow)]


@pytest.mark.parametrize("every", ORDERS)
def test_variants_never_modify_their_source_whatever_the_order(llama_export: onnx.ModelProto, every: bool) -> None:
    source = llama_export.SerializeToString(deterministic=True)
    alone = {v: make_variant(v, llama_export).proto.SerializeToString(deterministic=True) for v in ORDER_FREE}
    for order in _orders(ORDER_FREE, every):
        for v in order:
            assert make_variant(v, llama_export).proto.SerializeToString(deterministic=True) == alone[v], order
    assert llama_export.SerializeToString(deterministic=True) == source


@pytest.mark.parametrize("every", ORDERS)
def test_build_gives_identical_files_for_every_order_of_variants(
    llama_build: tuple[Path, dict[str, bytes]], tmp_path: Path, every: bool
) -> None:
    spec, files = llama_build  # built in the order BUILT
    for i, order in enumerate(_orders(BUILT, every)):
        assert _built(spec, tmp_path / f"out{i}", order) == files, order
