"""Build: real exports, real ONNX Runtime sessions, real comparisons with PyTorch."""

from __future__ import annotations

import itertools
import json
import os
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from attn_export.artifacts import files as artifacts
from attn_export.artifacts.files import LOCK_NAME, build_lock, sha256_file
from attn_export.artifacts.golden import GoldenCase, read_golden
from attn_export.artifacts.manifest import load_manifest
from attn_export.checks.fully_masked import judge, padded_query_rows
from attn_export.cli import cli
from attn_export.errors import GraphCheckError, LockError
from attn_export.exporter.factory import instantiate
from attn_export.exporter.graph_checks import check_dynamic_axes, graph_shapes
from attn_export.exporter.torch_export import export_onnx
from attn_export.model_spec import load_spec, variant_chain
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.model import Guard
from attn_export.model_spec.shapes import golden_points, sweep
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.pipelines.building.graphs import SpecBuild
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.torch_eager import TorchRuntime
from tests.conftest import APART_SPECS, ROOT, TINY_SPECS, Built, tiny_spec, write_spec

#: Every tiny zoo model: the shared zoo's, and in the slow set those it leaves out.
ZOO_NAMES = [
    *sorted(p.stem for p in TINY_SPECS),
    *(pytest.param(p.stem, marks=pytest.mark.slow) for p in APART_SPECS),
]


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_model_matches_pytorch_across_shapes(zoo_model: Callable[[str], Path], name: str) -> None:
    zoo_dir = zoo_model(name)
    entry = load_manifest(zoo_dir).models[name]
    spec = entry.model_spec
    points = sweep(spec)[:5]  # min, distinct, max, and the two skewed points
    assert any(len(set(p.sizes.values())) > 1 for p in points)
    tolerances = {t.name: spec.tolerance_for(t.name) for t in spec.outputs}
    with (
        TorchRuntime(instantiate(spec), spec.inputs, spec.outputs, spec.dims) as eager,
        OnnxRuntime(zoo_dir / entry.file, spec.inputs, spec.outputs, spec.dims) as ort_cpu,
    ):
        for i, point in enumerate(points):
            feeds = make_feeds(spec, point.sizes, i)
            case = GoldenCase(point.label, point.sizes, feeds, eager.run(feeds))
            # padded query rows as the spec says (left out under fully_masked = "ignore")
            results, _ = judge(spec, case, ort_cpu.run(feeds), tolerances)
            assert all(r.passed for r in results), (point, [r.reason() for r in results])


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_declared_axes_are_symbolic_and_distinct(zoo_model: Callable[[str], Path], name: str) -> None:
    zoo_dir = zoo_model(name)
    entry = load_manifest(zoo_dir).models[name]
    proto = onnx.load(zoo_dir / entry.file)
    check_dynamic_axes(proto, name, entry.model_spec.inputs, entry.model_spec.outputs, entry.model_spec.dims)
    shapes = graph_shapes(proto)
    dims = entry.model_spec.dims
    for t in entry.model_spec.inputs + entry.model_spec.outputs:
        # a sum dim may be its own symbol or the sum of its parts' ("past_seq + seq")
        sums = {d: " + ".join(dims[d].parts) for d in t.shape if isinstance(d, str) and dims[d].parts}
        assert [sums.get(d, d) if have != d else d for d, have in zip(t.shape, shapes[t.name], strict=True)] == list(
            shapes[t.name]
        )


def test_attention_op_model_holds_the_onnx_attention_op(zoo_dir: Path) -> None:
    proto = onnx.load(zoo_dir / "mha_attention_op.onnx")
    assert "Attention" in {n.op_type for n in proto.graph.node}
    assert {o.domain: o.version for o in proto.opset_import}[""] == 23


def test_metadata_records_provenance(zoo_dir: Path) -> None:
    meta = {p.key: p.value for p in onnx.load(zoo_dir / "mha.onnx").metadata_props}
    assert meta["attn_export.source_module"] == "attn_export.zoo.seed:MultiHeadAttention"
    assert meta["attn_export.exporter"] == "dynamo" and meta["attn_export.opset"] == "18"
    assert meta["attn_export.version.torch"] == torch.__version__
    assert meta["attn_export.spec_hash"] == load_manifest(zoo_dir).models["mha"].spec_hash
    assert {"attn_export.version.onnx", "attn_export.version.onnxscript"} <= set(meta)


def test_golden_vectors_cover_batch_one_and_unequal_lengths(zoo_dir: Path) -> None:
    cases = read_golden(zoo_dir / "mha_cross.golden.npz")
    sizes = [c.sizes for c in cases]
    assert {"batch": 1, "seq": 1, "kv_seq": 1} in sizes
    assert any(s["seq"] != s["kv_seq"] for s in sizes)
    case = cases[0]
    assert case.inputs["query"].shape == (case.sizes["batch"], case.sizes["seq"], 32)
    assert case.outputs["output"].dtype == np.float32


def test_merged_axes_export_is_caught(tmp_path: Path) -> None:
    spec = load_spec(tiny_spec(tmp_path))
    x = torch.randn(2, 5, 16)  # the same tensor as query, keys and values: the exporter merges
    proto = export_onnx(instantiate(spec), spec, {"query": x, "keys": x, "values": x})
    with pytest.raises(GraphCheckError, match=r"dynamic axes 'seq' and 'kv_seq' were merged into one symbol"):
        check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs)


def test_static_axis_is_caught(shared_tiny: Built) -> None:
    spec = load_spec(shared_tiny.models / "tiny.toml")
    proto = onnx.load(shared_tiny.out / "tiny.onnx")
    proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 3
    with pytest.raises(GraphCheckError, match=r"dynamic axis 'seq' of input 'query' \(axis 1\) is static 3"):
        check_dynamic_axes(proto, spec.name, spec.inputs, spec.outputs)


def _build(spec_paths: list[Path], out: Path, **kw: object):
    return build_models(spec_paths, BuildOptions(out, **kw))  # type: ignore[arg-type]


@pytest.mark.fresh_export
def test_build_is_deterministic(shared_tiny: Built, tmp_path: Path) -> None:
    path = tiny_spec(tmp_path / "models")  # the spec of the shared build, in another folder
    _build([path], tmp_path / "b")  # and in this process, where the shared one may have been built in another
    for name in ("tiny.onnx", "tiny.golden.npz", "manifest.json"):
        assert (shared_tiny.out / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_torchscript_exporter_builds_with_dynamic_axes(tmp_path: Path) -> None:
    summary = _build([tiny_spec(tmp_path / "models", exporter="torchscript")], tmp_path / "out")
    assert summary.results[0].status == "built", summary.results[0].error
    entry = load_manifest(tmp_path / "out").models["tiny"]
    assert entry.model_spec.exporter == "torchscript"
    assert graph_shapes(onnx.load(tmp_path / "out" / "tiny.onnx"))["keys"] == ("batch", "kv_seq", 16)


def test_incremental_build_skips_unchanged_and_rebuilds_changed(tmp_path: Path) -> None:
    # torchscript, the fastest exporter: what is tested here is not the export
    path = tiny_spec(tmp_path / "models", exporter="torchscript")
    out = tmp_path / "out"
    assert _build([path], out).results[0].status == "built"
    assert _build([path], out).results[0].status == "skipped"
    assert _build([path], out, force=True).results[0].status == "built"
    path.write_text(path.read_text().replace("max = 24", "max = 28"))
    assert _build([path], out).results[0].status == "built"
    (out / "tiny.onnx").write_bytes(b"tampered")
    assert _build([path], out).results[0].status == "built"


def test_crash_while_writing_leaves_previous_artifacts_intact(
    tiny_torchscript_build: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a copy of a build of tiny_spec, with torchscript (the fastest exporter): the subject is the rebuild
    built = tiny_torchscript_build
    path, out = built.models / "tiny.toml", built.out
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def killed(fd: int) -> None:
        raise KeyboardInterrupt  # as if the process died after writing, before the rename

    monkeypatch.setattr(artifacts.os, "fsync", killed)
    path.write_text(path.read_text().replace("max = 24", "max = 28"))
    with pytest.raises(KeyboardInterrupt):
        _build([path], out)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before
    entry = load_manifest(out).models["tiny"]
    assert sha256_file(out / entry.file) == entry.sha256


def test_user_module_outside_the_package_builds(tmp_path: Path) -> None:
    models = tmp_path / "user_models"
    models.mkdir()
    (models / "my_attention.py").write_text(
        textwrap.dedent("""
        import torch
        import torch.nn as nn

        class TemperatureAttention(nn.Module):
            def __init__(self, dim, temperature=2.0):
                super().__init__()
                self.proj = nn.Linear(dim, dim)
                self.temperature = temperature

            def forward(self, x, memory):
                scores = self.proj(x) @ memory.transpose(-2, -1) / self.temperature
                return torch.softmax(scores, dim=-1) @ memory
    """)
    )
    path = write_spec(
        models,
        "user",
        """
        module = "my_attention:TemperatureAttention"
        kwargs = { dim = 8, temperature = 3.0 }
        [[inputs]]
        name = "x"
        shape = ["batch", "seq", 8]
        [[inputs]]
        name = "memory"
        shape = ["batch", "mem", 8]
        [[outputs]]
        name = "out"
        shape = ["batch", "seq", 8]
        [dims]
        batch = { min = 1, max = 4 }
        seq = { min = 1, max = 16 }
        mem = { min = 1, max = 32 }
    """,
    )
    summary = _build([path], tmp_path / "out")
    assert summary.results[0].status == "built", summary.results[0].error
    assert load_manifest(tmp_path / "out").models["user"].spec["module"] == "my_attention:TemperatureAttention"


def test_one_failing_model_does_not_stop_the_others(tmp_path: Path) -> None:
    models = tmp_path / "models"
    bad = tiny_spec(models, "a_bad")
    bad.write_text(bad.read_text().replace("num_heads = 2", "heads = 2"))
    good = tiny_spec(models, "b_good")
    summary = _build([bad, good], tmp_path / "out")
    assert [r.status for r in summary.results] == ["failed", "built"]
    assert summary.results[0].stages["module"] is False
    assert "kwargs {'hidden_dim': 16, 'heads': 2} do not fit" in summary.results[0].error
    assert summary.exit_code == 2
    assert list(load_manifest(tmp_path / "out").models) == ["b_good"]
    fast = _build([bad, good], tmp_path / "out2", fail_fast=True)
    assert [r.status for r in fast.results] == ["failed"]


def test_smoke_check_failure_fails_the_build(tmp_path: Path) -> None:
    """With the frozen branch accepted, the export succeeds; the smoke check at the range's
    corners (seq = 1) still refuses the graph."""
    path = tiny_spec(tmp_path / "models", exporter="torchscript")
    text = path.read_text().replace(
        "attn_export.zoo.seed:MultiHeadAttention", "tests.faulty_modules:ShapeBranchAttention"
    )
    path.write_text("accept_guards = true\n" + text)
    summary = _build([path], tmp_path / "out")
    r = summary.results[0]
    assert r.stages["export"] is True and r.stages["smoke"] is False and summary.exit_code == 1
    assert r.error.startswith(
        "tiny: smoke check at corner-min-min-max (batch=1,seq=1,kv_seq=40) failed: the module's Python takes "
        "another path at batch=1,seq=1,kv_seq=40 than at the example"
    )
    # the branch's lines, then the numbers
    line = "return self.out_linear(self.v_linear(values).mean(dim=1, keepdim=True))"
    assert f"faulty_modules.py:{_line(line)} `{line}`" in r.error
    assert "; output: 16/16 elements" in r.error
    assert not (tmp_path / "out" / "tiny.onnx").exists()


def test_a_frozen_python_value_fails_the_torchscript_export(tmp_path: Path) -> None:
    path = tiny_spec(tmp_path / "models", exporter="torchscript")
    module = "tests.faulty_modules:ShapeBranchAttention"
    path.write_text(path.read_text().replace("attn_export.zoo.seed:MultiHeadAttention", module))
    r = _build([path], tmp_path / "out").results[0]
    assert r.failed_stage == "export"
    assert "the trace froze a value computed from a tensor at " in r.error and "faulty_modules.py:" in r.error


def test_train_mode_warns_and_exports_in_eval_mode(tmp_path: Path) -> None:
    path = tiny_spec(tmp_path / "models", exporter="torchscript")
    path.write_text('mode = "train"\n' + path.read_text())
    r = _build([path], tmp_path / "out").results[0]
    assert r.status == "built"
    assert r.warnings == ["spec asks for mode 'train'; exported in eval mode (dropout off)"]


def test_build_lock_refuses_a_second_build(tmp_path: Path) -> None:
    path = tiny_spec(tmp_path / "models")
    with build_lock(tmp_path / "out"), pytest.raises(LockError, match="locked by another attn-export build or verify"):
        _build([path], tmp_path / "out", lock_wait_s=0)


def test_second_build_waits_for_the_lock_then_gives_up(tmp_path: Path) -> None:
    path, out = tiny_spec(tmp_path / "models"), tmp_path / "out"
    notes: list[str] = []
    with build_lock(out), pytest.raises(LockError) as info:
        started = time.monotonic()
        build_models([path], BuildOptions(out, lock_wait_s=0.5), on_notice=notes.append)
    assert 0.5 <= time.monotonic() - started < 5
    assert notes == [f"{out} is locked by another attn-export build or verify; waiting up to 0.5 s"]
    assert str(info.value) == (
        f"{out} is locked by another attn-export build or verify after waiting 0.5 s; try again when it ends "
        "(--wait SECONDS waits longer)"
    )


def test_a_lock_that_guarded_nothing_goes_with_its_folders_and_a_waiting_build_locks_anew(tmp_path: Path) -> None:
    """A build that wrote nothing left its folder holding only the lock file, though it said
    nothing was written. The lock file now goes on release, and the folders made for it; a
    build waiting on the removed file locks the folder anew instead of sharing it."""
    out = tmp_path / "new" / "out"
    with build_lock(out):
        assert (out / LOCK_NAME).is_file()
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with build_lock(kept):
        (kept / "manifest.json").write_text("{}")
    assert sorted(p.name for p in kept.iterdir()) == [LOCK_NAME, "manifest.json"]
    held, release, inside = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with build_lock(out):
            held.set()
            release.wait(10)

    def second() -> None:
        with build_lock(out, wait_s=10):
            # the lock held is the folder's: a third build is refused, not let in beside it
            with pytest.raises(LockError), build_lock(out):
                pass
            inside.set()

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(10)
    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.3)  # the second build waits on the first's lock file
    release.set()
    thread.join()
    waiter.join()
    assert inside.is_set() and not out.exists()


def test_a_build_whose_folder_a_released_build_removed_makes_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a build's making its folder and opening the lock file in it, another build
    that wrote nothing may release and remove both: the build said "it no longer exists"."""
    out = tmp_path / "new" / "out"
    held, release, done = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with build_lock(out):
            held.set()
            release.wait(10)
        done.set()

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(10)
    opening = artifacts._open_lock

    def released_first(out_dir: Path, flags: int) -> int | None:
        if threading.current_thread() is threading.main_thread() and not done.is_set():
            release.set()  # the first build releases exactly here, after this one's mkdir
            done.wait(10)
        return opening(out_dir, flags)

    monkeypatch.setattr(artifacts, "_open_lock", released_first)
    with build_lock(out, wait_s=10):
        assert (out / LOCK_NAME).is_file()
    thread.join()


def test_second_build_runs_once_the_first_releases_the_lock(tmp_path: Path) -> None:
    path, out = tiny_spec(tmp_path / "models", exporter="torchscript"), tmp_path / "out"
    held, release = threading.Event(), threading.Event()

    def first_build() -> None:
        with build_lock(out):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=first_build)
    thread.start()
    held.wait(10)
    threading.Timer(0.5, release.set).start()
    notes: list[str] = []
    summary = build_models([path], BuildOptions(out, lock_wait_s=30), on_notice=notes.append)
    thread.join()
    assert [r.status for r in summary.results] == ["built"]
    assert notes == [f"{out} is locked by another attn-export build or verify; waiting up to 30 s"]


def test_manifest_records_the_contract(zoo_dir: Path) -> None:
    doc = json.loads((zoo_dir / "manifest.json").read_text())
    assert doc["schema"] == "attn-export/manifest" and doc["schema_version"] == 2
    entry = doc["models"]["mha_cross"]
    # the spec is stored once; nothing beside it repeats its fields
    assert not {"inputs", "outputs", "dims", "tolerance", "opset", "exporter"} & set(entry)
    spec = entry["spec"]
    assert spec["inputs"][1] == {"name": "keys", "dtype": "float32", "shape": ["batch", "kv_seq", 32]}
    assert spec["dims"]["kv_seq"] == {"min": 1, "max": 40}
    assert spec["tolerance"]["atol"] == 1e-5
    assert entry["sha256"] == sha256_file(zoo_dir / "mha_cross.onnx")
    assert set(entry["versions"]) == {"attn_export", "torch", "onnx", "onnxscript", "onnxruntime"}
    assert os.stat(zoo_dir / "mha_cross.onnx").st_mode & 0o044  # readable by others, like any build output


def _branch_spec(folder: Path, extra: str = "") -> Path:
    path = tiny_spec(folder)
    text = path.read_text().replace(
        "attn_export.zoo.seed:MultiHeadAttention", "tests.faulty_modules:LongSequenceBranchAttention"
    )
    path.write_text(extra + text.replace("seq = { min = 1, max = 24 }", "seq = { min = 1, max = 128 }"))
    return path


def _branch_line() -> int:
    source = (ROOT / "tests" / "faulty_modules.py").read_text().splitlines()
    return next(i for i, line in enumerate(source, 1) if "query.shape[1] > 64" in line)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_branch_on_a_shape_fails_the_build_naming_its_line(tmp_path: Path, exporter: str) -> None:
    summary = _build([_branch_spec(tmp_path / "models")], tmp_path / "out", exporter=exporter)
    result = summary.results[0]
    assert result.status == "failed" and result.failed_stage == "export"
    assert f"tests/faulty_modules.py:{_branch_line()}" in result.error
    assert not (tmp_path / "out" / "tiny.onnx").exists()


@pytest.mark.slow
def test_an_accepted_guard_is_still_judged_on_the_whole_range(tmp_path: Path) -> None:
    models = tmp_path / "models"
    summary = _build([_branch_spec(models, "accept_guards = true\n")], tmp_path / "out")
    error = summary.results[0].error  # torch narrowed seq to <= 64: smoke fails just past it, first
    assert error.startswith("tiny: smoke check at guard-1 (batch=2,seq=65,kv_seq=5) failed: "), error
    assert f"the guard seq <= 64 (at tests/faulty_modules.py:{_branch_line()} `if query.shape[1] > 64:`)" in error


def test_golden_points_cover_every_corner_of_the_declared_range(tmp_path: Path) -> None:
    spec = load_spec(tiny_spec(tmp_path))
    sizes = [p.sizes for p in golden_points(spec)]
    for mix in itertools.product(("min", "max"), repeat=3):
        corner = {k: getattr(spec.dims[k], m) for k, m in zip(spec.dims, mix, strict=True)}
        assert corner in sizes, corner


def _line(text: str) -> int:
    source = (ROOT / "tests" / "faulty_modules.py").read_text().splitlines()
    return next(i for i, line in enumerate(source, 1) if text in line)


@pytest.mark.slow  # a build (6 s); test_guards checks the fast path on the tiny zoo's recorded guard
def test_an_accepted_guard_is_smoke_checked_where_it_fails(tmp_path: Path) -> None:
    """A graph traced past ``if seq == 7`` agrees with PyTorch at every corner of the range:
    the build finds the sizes where each accepted guard fails (over a range wider than any
    scan, and on a dim two inputs share), and smoke-checks them first."""
    path = tiny_spec(tmp_path / "models")
    text = path.read_text().replace("attn_export.zoo.seed:MultiHeadAttention", "tests.faulty_modules:SevenAttention")
    path.write_text(
        "accept_guards = true\n" + text.replace("seq = { min = 1, max = 24 }", "seq = { min = 1, max = 4096 }")
    )
    r = _build([path], tmp_path / "out").results[0]

    def guard(condition: str, line: str, sizes: str) -> str:
        at = f"tests/faulty_modules.py:{_line(line)} `{line}`"
        return f"accepted guard {condition} (at {at}): smoke-checked and verified where it fails, at {sizes}"

    wide = "batch=2,seq=1280,kv_seq=5; batch=2,seq=1343,kv_seq=5"  # found over all 4096 sizes
    assert r.warnings[0] == guard("seq != 7", "if query.shape[1] == 7:", "batch=2,seq=7,kv_seq=5")
    assert set(r.warnings[1:3]) == {
        guard("batch != 3", "if query.shape[0] == 3:", "batch=3,seq=3,kv_seq=5"),  # a dim three inputs share
        guard("(seq//64) != 20", "if query.shape[1] // 64 == 20:", wide),
    }
    seven = f"seq != 7 (at tests/faulty_modules.py:{_line('query.shape[1] == 7')} `if query.shape[1] == 7:`)"
    assert r.failed_stage == "smoke" and r.error.startswith(
        "tiny: smoke check at guard-1 (batch=2,seq=7,kv_seq=5) failed: the module's Python takes another path at "
        "batch=2,seq=7,kv_seq=5 than at the example the graph was exported at, where the spec accepted the guard "
        + seven
    ), r.error
    assert "; output: " in r.error  # and the numbers
    assert not (tmp_path / "out" / "tiny.onnx").exists()


@pytest.mark.slow  # a failed export (5 s)
@pytest.mark.parametrize("accept_guards", [False, True])
def test_a_branch_on_values_fails_its_export_naming_the_line(tmp_path: Path, accept_guards: bool) -> None:
    """torch's own message names an unbacked symbol; the export wrapped it in "Failed to
    export" where the spec accepts guards. Both now say where, and what to write instead."""
    path = tiny_spec(tmp_path / "models")
    text = path.read_text().replace(
        "attn_export.zoo.seed:MultiHeadAttention", "tests.faulty_modules:ValueBranchAttention"
    )
    path.write_text(("accept_guards = true\n" if accept_guards else "") + text)
    r = _build([path], tmp_path / "out").results[0]
    line = "if query.abs().max() > 50:"
    assert r.failed_stage == "export" and "GuardOnDataDependentSymNode: Could not guard on data-dependent" in r.error
    assert f"at tests/faulty_modules.py:{_line(line)} `{line}`" in r.error, r.error
    assert "a branch on a tensor's values, not its shape, is not a graph: write it with torch.where" in r.error
    if not accept_guards:  # the line says --debug shows the traceback: it printed the same line
        args = ["build", str(path), "--out", str(tmp_path / "again")]
        quiet, loud = (CliRunner().invoke(cli, [*debug, *args]) for debug in ([], ["--debug"]))
        assert quiet.exit_code == loud.exit_code == 1 and "Traceback" not in quiet.output, quiet.output
        told = loud.output.split(r.error, 1)[1]
        assert told.startswith("\nTraceback (most recent call last):\n"), told
        assert f"    {line}\n" in told and "GuardOnDataDependentSymNode" in told  # the module's frame and torch's error


@pytest.mark.slow  # a failed export (5 s)
def test_a_dim_the_code_fixes_fails_an_export_that_accepts_guards_naming_the_line(tmp_path: Path) -> None:
    """Accepting guards, torch fixes the length to the example's rather than fail; before,
    build said only that the axis was static."""
    path = tiny_spec(tmp_path / "models")
    text = path.read_text().replace("attn_export.zoo.seed:MultiHeadAttention", "tests.faulty_modules:LogScaleAttention")
    path.write_text("accept_guards = true\n" + text)
    r = _build([path], tmp_path / "out").results[0]
    line = "return super().forward(query, keys, values) * math.log(query.shape[1] + 1)"
    assert r.failed_stage == "export" and r.error.startswith(
        "tiny: the module's code fixes dim 'seq' (input 'query', axis 1) to the example's size 3 at "
        f"tests/faulty_modules.py:{_line(line)} `{line}`, so the graph holds at that size only"
    ), r.error
    path.write_text(path.read_text().replace("LogScaleAttention", "TwoFixedDimsAttention"))
    r = _build([path], tmp_path / "out").results[0]
    branch = "if keys.shape[1] == 5:"
    assert r.error.startswith(
        f"tiny: the module's code fixes dim 'seq' (input 'query', axis 1) to the example's size 3 at "
        f"tests/faulty_modules.py:{_line(line)} `{line}`; dim 'kv_seq' (input 'keys', axis 1) to the example's "
        f"size 5 at tests/faulty_modules.py:{_line(branch)} `{branch}`, so the graph holds at those sizes only"
    ), r.error


def test_a_variant_failing_where_its_export_agrees_is_blamed_not_an_accepted_guard(tmp_path: Path) -> None:
    """A guard failing at a case says nothing of a variant whose own export agrees there:
    the smoke check names the variant (and for a lossy one, its tolerance's table) instead.
    The fp16 graph is judged here at a tolerance no float16 graph meets."""
    path = tiny_spec(tmp_path / "models")
    path.write_text(path.read_text() + "\n[variants.fp16]\natol = 1e-7\nrtol = 0.0\natol_rms = 1e-7\nrms_rtol = 1e-7\n")
    spec = load_spec(path)
    build = SpecBuild(spec, {}, BuildOptions(tmp_path / "out"))
    guarded = SpecBuild(replace(spec, guards=(Guard("seq != 3", points=(dict(build.sizes),)),)), {}, build.options)
    with pytest.raises(GraphCheckError) as caught:
        guarded.smoke("fp16", guarded.graph("fp16").model)
    message = str(caught.value)
    assert "smoke check at example" in message, message
    assert (
        "the export it was made from agrees here at the spec's own tolerance, so the variant differs, by a fault "
        "or by fp16's rounding (where that is all it is, give [variants.fp16] atol_rms and rms_rtol in the spec) "
        "(fp16: float16 inside, float32 inputs and outputs); output: " in message
    )
    assert "accepted the guard" not in message
    assert variant_chain("ort-past+int8").table == 'variants."ort-past+int8"'


def test_a_variant_is_blamed_where_its_export_differs_only_on_rows_build_repairs(tmp_path: Path) -> None:
    """The export a variant was made from is not repaired: on a left-padded prompt it differs
    from PyTorch in the rows that see no key, as the variant's graph did before build's
    repair. It is judged on the other rows, where it agrees, so the variant is still named."""
    from tests.checks.test_padded_rows import ONE_SEQUENCE

    spec = load_spec(write_spec(tmp_path / "models", "padded", ONE_SEQUENCE.replace("{rule}", "")))
    build = SpecBuild(spec, {}, BuildOptions(tmp_path / "out"))
    case = next(c for c in build.golden.get() if c.label == "max")
    assert padded_query_rows(spec, case)[1]  # its first tokens padding, which sees no key
    said = build._rewrite_differs("fp16", case)
    assert said is not None and said.startswith("the export it was made from agrees here"), said


def test_nan_from_a_bool_input_declared_no_mask_names_the_input_and_what_to_declare(tmp_path: Path) -> None:
    """nn.MultiheadAttention's attn_mask given without mask = ...: its drawn values hide a
    whole row at seq 1, the graph gives NaN where PyTorch gives 0, and the smoke check said
    only "32 NaN/Inf where expected is finite"."""
    body = (ROOT / "tests" / "models" / "torch_mha.toml").read_text()
    body = body.replace('shape = ["batch", "kv_seq"]        # [batch, kv_seq]: key padding\nmask = "padding"\n', "")
    body = body.replace(
        'name = "key_padding_mask"\ndtype = "bool"\n', 'name = "attn_mask"\ndtype = "bool"\nshape = ["seq", "kv_seq"]\n'
    )
    body = body.replace('convention = "ignore"              # True = ignore, as nn.MultiheadAttention reads it\n', "")
    body = body.replace('arg = "key_padding_mask"', 'arg = "attn_mask"')
    spec = write_spec(tmp_path / "models", "keep_mask", body)
    summary = build_models([spec], BuildOptions(tmp_path / "out"))
    (result,) = summary.results
    assert (
        result.error is not None
        and ": input 'attn_mask' is bool and declared no mask, so its values were drawn at " in result.error
    ), result.error
    assert "NaN/Inf where expected is finite" in result.error, result.error
