"""Shared fixtures and helpers.

Build once and copy: ``shared_build`` builds a folder once per test session, whichever
pytest-xdist worker asks for it first (under a file lock next to it, in the session's
temporary root, which every worker shares), and every test that only reads it reads that
one; a test that changes a folder takes its own copy (``copy_build``). A shared folder is
checked unchanged when its fixture ends. The zoo is built in two halves, one per worker at
the same time, and put together as one build writes it (``shared_zoo``). A process exports
each module once (``tests/export_memo.py``): a later build or localize of the same module,
spec and feeds takes a copy of that export.

The tests use the tiny zoo in ``tests/models``: every model of ``models/`` as the same spec
at hidden sizes of at most 32 and lengths of at most 40 (``tests/model_spec/test_spec.py`` holds
it to that), fast to export and to run. The production-size zoo of ``models/`` is built and
verified by one test, ``tests/pipelines/test_production_zoo.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import numpy_helper

from attn_export.artifacts.files import sha256_file
from attn_export.artifacts.manifest import MANIFEST_NAME, Manifest, load_manifest, save_manifest
from attn_export.exporter.variants import make_variant
from attn_export.model_spec import load_spec, spec_paths
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.pipelines.verify import VerifyOptions, case_plan
from attn_export.pipelines.verify.models import checkout_spec
from tests import export_memo

ROOT = Path(__file__).resolve().parent.parent
#: The production-size zoo, as `attn-export build` builds it by default.
ZOO = ROOT / "models"
#: The tiny zoo every other test builds and verifies.
TINY_ZOO = ROOT / "tests" / "models"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
#: For tests of Hugging Face layers: CI installs the test extra, which has transformers.
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="needs transformers (pip install -e '.[export,hf,test]')"
)


def _needs_hf(path: Path) -> bool:
    spec = load_spec(path)
    return any(t.startswith("transformers") for t in (spec.module, (spec.config or {}).get("class", "")))


def buildable(folder: Path) -> list[Path]:
    """The spec files of a zoo this environment can build (the Hugging Face ones need transformers)."""
    return [p for p in spec_paths(folder) if HAS_TRANSFORMERS or not _needs_hf(p)]


def zoo_cases(built: Path, specs: Sequence[Path], options: VerifyOptions | None = None) -> int:
    """Cases a verify of these specs' graphs in ``built`` runs: every model's sweep, with the
    sizes where the guards its build accepted fail, named mask cases included."""
    models = load_manifest(built).models
    specs = [checkout_spec(p.parent, models[p.stem]) for p in specs]
    return sum(len(case_plan(spec, options or VerifyOptions())) for spec in specs)


#: Tiny zoo models the shared zoo (``tiny_zoo``) leaves out: Hugging Face decoders that each
#: differ from ``llama_sdpa_kv_cache`` in one setting (eager attention; a sliding window; two
#: layers and the language-model head), with the slowest exports of the zoo. The tests that
#: name one build it alone (``zoo_model``, ``causal_lm``).
APART = ("llama_model_kv_cache", "mistral_sdpa_kv_cache", "llama_causal_lm")
#: The shared zoo's spec files this environment can build, and the cases a default verify runs;
#: ``APART_SPECS``, the rest of the tiny zoo's.
TINY_SPECS = [p for p in buildable(TINY_ZOO) if p.stem not in APART]
APART_SPECS = [p for p in buildable(TINY_ZOO) if p.stem in APART]


# -- one core per worker -------------------------------------------------------------------------


def _one_core_per_worker() -> None:
    """Under pytest-xdist, PyTorch and ONNX Runtime run one intra-op thread unless a test
    asks for more: each worker has one of the machine's cores, and two workers' thread
    pools spinning on the same cores made the default set 15-20 % slower."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import onnxruntime
    import torch

    torch.set_num_threads(1)
    # and the processes a test starts (build --jobs, Ray): PyTorch's float32 sums, which
    # golden files hold, round by the thread count, and a folder built by any executor
    # must be byte for byte a serial build's
    os.environ["OMP_NUM_THREADS"] = "1"

    class OneThread(onnxruntime.SessionOptions):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.intra_op_num_threads = 1

    onnxruntime.SessionOptions = OneThread  # type: ignore[misc]


_one_core_per_worker()
export_memo.install()
# A test process allocates graphs, FX programs and tensors by the million: at CPython's
# young-generation threshold (700) its collections took about 10 s of each worker's run of
# the default set, 1.5-3 s at this one (measured with gc.callbacks); memory peaked the same.
gc.set_threshold(50_000, 20, 20)


@pytest.fixture(autouse=True)
def _fresh_export(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``fresh_export`` exports every module itself (``tests/export_memo.py``)."""
    export_memo.BYPASS[0] = request.node.get_closest_marker("fresh_export") is not None
    yield
    export_memo.BYPASS[0] = False


# -- build once and copy -----------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    """A shared build: its output folder, the folder its specs are in, and each graph's
    build error (None where it built)."""

    out: Path
    models: Path
    errors: dict[str, str | None]


def _session_root(factory: pytest.TempPathFactory) -> Path:
    """A folder every process of this test session shares: the base temporary folder, or
    under pytest-xdist its parent, which holds each worker's own."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """``make(folder)`` once per test session, in whichever process asks first: the others
    wait on the lock, then read the record it returned."""
    root = _session_root(factory) / "shared-builds"
    root.mkdir(exist_ok=True)
    record = root / f"{name}.json"
    with _locked(root / f"{name}.lock"):
        if not record.exists():
            shutil.rmtree(root / name, ignore_errors=True)  # what a process that died while building left
            record.write_text(json.dumps(make(root / name)))
        return json.loads(record.read_text())


def shared_build(
    factory: pytest.TempPathFactory,
    name: str,
    specs: Callable[[Path], list[Path]] | Sequence[Path],
    **options: object,
) -> Built:
    """Build once per test session, in whichever process asks first; the others wait on
    the lock and read the same folder. ``specs`` is a list of spec files, or a function
    writing them into the folder it is given. Tests must not change the folder it returns:
    ``copy_build`` gives one to change."""

    def build(folder: Path) -> dict[str, Any]:
        paths = specs(folder / "models") if callable(specs) else list(specs)
        summary = build_models(paths, BuildOptions(folder / "out", **options))  # type: ignore[arg-type]
        return {"models": str(paths[0].parent), "errors": {r.name: r.error for r in summary.results}}

    done = _once(factory, name, build)
    return Built(_session_root(factory) / "shared-builds" / name / "out", Path(done["models"]), done["errors"])


def shared_zoo(factory: pytest.TempPathFactory, name: str, specs: Sequence[Path], parts: int = 2) -> Built:
    """``shared_build`` of a zoo (with recorded intermediates), in parts the xdist workers build at the same time (each
    starts with its own part, then waits only for a part another is building), put together
    as one build of them all writes its folder: every part's files, and one manifest of all
    their entries (builds are deterministic, and a manifest holds nothing but its entries)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    order = [(worker + i) % parts for i in range(parts)]
    built = {
        i: shared_build(factory, f"{name}-part{i + 1}of{parts}", specs[i::parts], record_intermediates=True)
        for i in order
    }

    def assemble(folder: Path) -> dict[str, Any]:
        out = folder / "out"
        out.mkdir(parents=True)
        manifests = [load_manifest(built[i].out) for i in range(parts)]
        for i in range(parts):
            for path in built[i].out.iterdir():
                if path.name != MANIFEST_NAME:
                    shutil.copy2(path, out / path.name)
        entries = {k: v for m in manifests for k, v in m.models.items()}
        save_manifest(out, Manifest(manifests[0].toolkit_version, entries))
        errors = {k: v for i in range(parts) for k, v in built[i].errors.items()}
        return {"models": str(specs[0].parent), "errors": errors}

    done = _once(factory, name, assemble)
    return Built(_session_root(factory) / "shared-builds" / name / "out", Path(done["models"]), done["errors"])


def built_on_demand(factory: pytest.TempPathFactory, write: Callable[[Path, str], Path]) -> Callable[[str], Built]:
    """A builder of one spec at a time, each when a test first asks for it by name (so a
    test pays only for the graphs it reads): ``write(folder, name)`` writes its spec file."""
    built: dict[str, Built] = {}

    def build(name: str) -> Built:
        if name not in built:
            root = factory.mktemp(name)
            summary = build_models([write(root / "models", name)], BuildOptions(root / "out"))
            built[name] = Built(root / "out", root / "models", {r.name: r.error for r in summary.results})
        return built[name]

    return build


def copy_build(built: Built, dest: Path) -> Built:
    """A copy of a shared build to change: ``dest/out``, and ``dest/models`` where its specs
    were written for it (a zoo's spec folder is never copied: it is the checkout's)."""
    shutil.copytree(built.out, dest / "out")
    models = built.models
    if built.models == built.out.parent / "models":
        models = dest / "models"
        shutil.copytree(built.models, models)
    return Built(dest / "out", models, built.errors)


def _fingerprint(folder: Path) -> dict[str, tuple[int, int]]:
    files = (p for p in sorted(folder.rglob("*")) if "__pycache__" not in p.parts)
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


@contextlib.contextmanager
def unchanged(folder: Path) -> Iterator[None]:
    """Fail if the tests that read a shared folder changed it (they must take a copy)."""
    before = _fingerprint(folder)
    yield
    assert _fingerprint(folder) == before, f"a test changed the shared build {folder}; take a copy (copy_build)"


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The tiny zoo, built once per session; tests that modify it take a copy (``zoo_copy``)."""
    built = shared_zoo(tmp_path_factory, "zoo", TINY_SPECS)
    failed = {n: e for n, e in built.errors.items() if e is not None}
    assert not failed, failed
    with unchanged(built.out):
        yield built


@pytest.fixture(scope="session")
def zoo_model(tiny_zoo: Built, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The build folder that holds a tiny zoo model's graph: the shared zoo's, or for one it
    leaves out (``APART``) a build of that model alone, shared by every test that asks."""

    def out(name: str) -> Path:
        if name not in APART:
            return tiny_zoo.out
        built = shared_build(tmp_path_factory, f"zoo-{name}", [TINY_ZOO / f"{name}.toml"], record_intermediates=True)
        assert built.errors == {name: None}, built.errors
        return built.out

    return out


@pytest.fixture(scope="session")
def causal_lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The tiny zoo's two-layer causal LM, fp32 and int4, built once per session with ``--target genai``."""
    spec = [TINY_ZOO / "llama_causal_lm.toml"]
    built = shared_build(tmp_path_factory, "causal-lm", spec, target="genai", variants=("fp32", "int4"))
    assert built.errors == {"llama_causal_lm": None, "llama_causal_lm.int4": None}, built.errors
    with unchanged(built.out):
        yield built


@pytest.fixture(scope="session")
def zoo_dir(tiny_zoo: Built) -> Path:
    """The tiny zoo's build folder (verify it with ``--models tests/models``: ``TINY_ZOO``)."""
    return tiny_zoo.out


@pytest.fixture
def zoo_copy(zoo_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "zoo"
    shutil.copytree(zoo_dir, dest)
    return dest


@pytest.fixture(scope="session")
def shared_tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """``tiny_spec`` (dynamo) built once per session."""
    built = shared_build(tmp_path_factory, "tiny", lambda models: [tiny_spec(models)])
    assert built.errors == {"tiny": None}, built.errors
    with unchanged(built.out), unchanged(built.models):
        yield built


@pytest.fixture
def tiny_build(shared_tiny: Built, tmp_path: Path) -> Built:
    """A copy of ``tiny_spec``'s build to change: ``tmp_path/out`` and its specs in ``tmp_path/models``."""
    return copy_build(shared_tiny, tmp_path)


@pytest.fixture(scope="session")
def shared_tiny_torchscript(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """``tiny_spec`` built once per session with torchscript, the fastest exporter, for tests
    that rebuild it and whose subject is not the export."""
    built = shared_build(
        tmp_path_factory, "tiny-torchscript", lambda models: [tiny_spec(models, exporter="torchscript")]
    )
    assert built.errors == {"tiny": None}, built.errors
    with unchanged(built.out), unchanged(built.models):
        yield built


@pytest.fixture
def tiny_torchscript_build(shared_tiny_torchscript: Built, tmp_path: Path) -> Built:
    """A copy of ``shared_tiny_torchscript`` to change, as ``tiny_build`` is of ``shared_tiny``."""
    return copy_build(shared_tiny_torchscript, tmp_path)


def one_stream(text: str) -> str:
    """A decoder's spec at batch 1 only: a single decoding stream, as on a CPU server."""
    assert "batch = { min = 1, max = 4 }\n" in text
    text = text.replace("batch = { min = 1, max = 4 }\n", "").replace('["batch", ', "[1, ")
    return text.replace('mask = "left-padding"\n', 'mask = "left-padding"\nlayout = "key-padding"\n')


#: What ``cache_build`` builds of each decoder: the variants with a cache, and chains that
#: start from them (a chain costs its links and a smoke run: the export is shared).
CACHE_VARIANTS = ("attention-op", "ort-past", "ort-past+int8", "attention-op+fp16")


def _decoder_specs(models: Path) -> list[Path]:
    gqa = (TINY_ZOO / "gqa_rope_kv_cache.toml").read_text()
    return [
        write_spec(models, "mha_kv_cache", (TINY_ZOO / "mha_kv_cache.toml").read_text()),
        write_spec(models, "gqa_rope_kv_cache", gqa),
        write_spec(models, "gqa_one_stream", one_stream(gqa)),
    ]


@pytest.fixture(scope="session")
def cache_build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The tiny zoo's MHA and GQA decoders, and the GQA one at batch 1, with ``CACHE_VARIANTS``,
    built once per session (a graph ONNX Runtime cannot run at a declared size fails: its
    error is in ``errors``)."""
    built = shared_build(tmp_path_factory, "cache-variants", _decoder_specs, variants=CACHE_VARIANTS)
    with unchanged(built.out), unchanged(built.models):
        yield built


# -- specs ----------------------------------------------------------------------------------------


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


def build_tiny_with(tmp_path: Path, module: type, exporter: str = "dynamo") -> Any:
    """``attn-export build`` of ``tiny_spec`` with ``module`` (the seed MHA's signature) in
    its place, into ``tmp_path / "out"``: the CLI's result."""
    from click.testing import CliRunner

    from attn_export.cli import cli

    spec = tiny_spec(tmp_path / "models", exporter=exporter)
    seed_mha = 'module = "attn_export.zoo.seed:MultiHeadAttention"'
    spec.write_text(spec.read_text().replace(seed_mha, f'module = "{module.__module__}:{module.__name__}"'))
    return CliRunner().invoke(cli, ["build", str(spec), "--out", str(tmp_path / "out")])


# -- planting faults ------------------------------------------------------------------------------


def clamp_input(path: Path, name: str, top: int) -> Any:
    """The graph at ``path`` with its integer input ``name`` clamped to ``top`` before any
    node reads it, as a table cut short or a rotary capped at some length would read it."""
    import onnx

    proto = onnx.load(path)
    graph = proto.graph
    for n in graph.node:
        n.input[:] = [f"{name}_clamped" if i == name else i for i in n.input]
    graph.initializer.append(onnx.helper.make_tensor(f"{name}_top", onnx.TensorProto.INT64, [], [top]))
    graph.node.insert(0, onnx.helper.make_node("Min", [name, f"{name}_top"], [f"{name}_clamped"]))
    return proto


def plant(
    out_dir: Path, name: str, proto_or_bytes: object, module: str | None = None, models: Path | None = None
) -> None:
    """Replace a built model's graph and fix up its manifest hash, as a careless edit would;
    ``module`` also swaps the PyTorch original in the checkout's spec (``models``) and
    records it in the manifest, as a script that exported the module without comparing
    the two would."""
    import onnx

    from attn_export.artifacts.files import sha256_file

    path = out_dir / f"{name}.onnx"
    if isinstance(proto_or_bytes, onnx.ModelProto):
        onnx.save(proto_or_bytes, path)
    else:
        path.write_bytes(proto_or_bytes)  # type: ignore[arg-type]
    manifest_path = out_dir / "manifest.json"
    doc = json.loads(manifest_path.read_text())
    entry = doc["models"][name]
    entry["sha256"] = sha256_file(path)
    manifest_path.write_text(json.dumps(doc, indent=2))
    if module is not None:
        assert models is not None
        old = entry["spec"]["module"]
        edit_spec(out_dir, models, name, {f'module = "{old}"': f'module = "{module}"'})


def edit_spec(out_dir: Path, models: Path, name: str, edits: dict[str, str]) -> None:
    """Edit a built model's spec in the checkout (``models``), each ``old: new`` a text
    replacement in its TOML, and record the edited spec in the manifest as a build of it
    would: verify finds the build current, not stale."""
    from attn_export.exporter.source import module_sources

    manifest_path = out_dir / "manifest.json"
    doc = json.loads(manifest_path.read_text())
    entry = doc["models"][name]
    spec_path = models / f"{entry['spec']['name']}.toml"
    text = spec_path.read_text()
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    spec_path.write_text(text)
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


# -- peak memory ----------------------------------------------------------------------------------

#: Runs its arguments as a command and prints, last on stderr, the command's peak RSS (KiB):
#: the largest of it and every process it waited for. A process of its own, small, so that
#: its children's peak is theirs alone (a child started from pytest counts pytest's RSS too:
#: Linux carries it across fork and exec).
_PEAK_RSS = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)"
)


def endless_loop(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with a float bias passed through a Loop that never stops, before its reader:
    a graph that runs until something stops it."""
    import numpy as np

    bias = next(t for t in proto.graph.initializer if len(t.dims) == 1 and t.data_type == onnx.TensorProto.FLOAT)
    reader = next(n for n in proto.graph.node if bias.name in n.input)
    scalar, kinds = onnx.helper.make_tensor_value_info, onnx.TensorProto
    body = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            onnx.helper.make_node("Identity", ["v"], ["v_out"]),
        ],
        "body",
        [scalar("i", kinds.INT64, []), scalar("cond_in", kinds.BOOL, []), scalar("v", kinds.FLOAT, list(bias.dims))],
        [scalar("cond_out", kinds.BOOL, []), scalar("v_out", kinds.FLOAT, list(bias.dims))],
    )
    spin = onnx.helper.make_node("Loop", ["", "always", bias.name], ["spun"], body=body, name="spin")
    reader.input[list(reader.input).index(bias.name)] = "spun"
    nodes = list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend([spin, *nodes])
    proto.graph.initializer.append(numpy_helper.from_array(np.array(True), "always"))
    return proto


def peak_rss(args: Sequence[str], **kwargs: Any) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run a command in a fresh process; its result (stdout and stderr as text) and its peak
    resident memory in bytes. ``kwargs`` go to ``subprocess.run`` (``cwd``, ``env``)."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, *args], capture_output=True, text=True, timeout=300, **kwargs
    )
    stderr, _, last = done.stderr.rstrip("\n").rpartition("\n")
    done.stderr = stderr
    return done, int(last) * 1024


def add_variant(out: Path, model: str, variant: str) -> str:
    """The variant made from the built plain graph and entered in the manifest, as build
    makes it (without its smoke check: the point is to break it)."""
    manifest = load_manifest(out)
    name = f"{model}.{variant}"
    graph = make_variant(variant, onnx.load(out / f"{model}.onnx")).proto
    onnx.save(graph, out / f"{name}.onnx")
    entry = dataclasses.replace(
        manifest.models[model], name=name, file=f"{name}.onnx", variant=variant, intermediates="",
        intermediates_sha256="", sha256=sha256_file(out / f"{name}.onnx"),
    )  # fmt: skip
    manifest.models[name] = entry
    save_manifest(out, manifest)
    return name


def scale_initializer(proto: onnx.ModelProto, name: str, factor: float) -> None:
    init = next(i for i in proto.graph.initializer if i.name == name)
    value = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((value * factor).astype(value.dtype), name))


def key_scale_off(out: Path, name: str, factor: float) -> None:
    """The int8 scale of the key projection's weight (BERT's ``self.key``, FX node
    ``linear_1``) times ``factor``: the key a quarter off at 1.25, which the outputs'
    int8 tolerance lets through (its attention averages the error away)."""
    proto = onnx.load(out / f"{name}.onnx")
    bias_add = next(n for n in proto.graph.node if n.name == "node_linear_1")
    dequantized = next(n for n in proto.graph.node if bias_add.input[0] in n.output)  # the scales' Mul
    integer = next(n for n in proto.graph.node if dequantized.input[0] in n.output)  # the Cast
    matmul = next(n for n in proto.graph.node if integer.input[0] in n.output)
    assert matmul.op_type == "MatMulInteger", matmul.op_type
    scale_initializer(proto, matmul.input[1].removesuffix("_quantized") + "_scale", factor)
    plant(out, name, proto)


@pytest.fixture(scope="session")
def shared_bert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The tiny zoo's BERT layer, plain and int8, alone in a folder with its spec (in
    ``models``): built once per session for the faces that verify a whole folder."""

    def specs(models: Path) -> list[Path]:
        models.mkdir(parents=True)
        return [Path(shutil.copy(TINY_ZOO / "bert_attention.toml", models))]

    built = shared_build(tmp_path_factory, "bert", specs, variants=("fp32", "int8"))
    assert built.errors == {"bert_attention": None, "bert_attention.int8": None}, built.errors
    with unchanged(built.out), unchanged(built.models):
        yield built
