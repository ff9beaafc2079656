"""A graph that crashes ONNX Runtime itself (a segfault in one of its graph optimizers, not
an error it reports) fails that graph at build, and the build goes on: before, the process
died with nothing said and every graph after it was lost."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from attn_export.cli import cli
from attn_export.errors import RuntimeFailure
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.runtimes import ort
from tests.conftest import TINY_ZOO, Built


def _identity() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def test_a_crash_is_told_from_a_load_and_from_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ort.crash_on_load(_identity()) is None
    assert ort.crash_on_load(b"not a model") is None  # an error: the real load reports it
    monkeypatch.setattr(ort, "load_session", lambda *a, **k: os.kill(os.getpid(), signal.SIGSEGV))
    assert ort.crash_on_load(_identity()) == "was killed by SIGSEGV"
    monkeypatch.setattr(ort, "load_session", lambda *a, **k: signal.pause())
    assert ort.crash_on_load(_identity(), wait_s=0.5) == "hung for 0.5 s"
    monkeypatch.undo()
    was = signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped unseen: no end to tell
    try:
        assert ort.crash_on_load(_identity()) is None
    finally:
        signal.signal(signal.SIGCHLD, was)


@pytest.mark.slow  # an export of its own; the mechanism is tested above
def test_an_fp16_graph_that_crashes_onnx_runtime_fails_and_the_build_goes_on(tmp_path: Path) -> None:
    """nn.MultiheadAttention's float16 graph crashes ONNX Runtime 1.32's CPU optimizers."""
    paths = [TINY_ZOO / "torch_mha.toml", TINY_ZOO / "sdpa.toml"]
    summary = build_models(paths, BuildOptions(tmp_path / "out", variants=("fp16",)))
    status = {r.name: (r.status, r.error) for r in summary.results}
    assert status["sdpa.fp16"] == ("built", None)
    assert status["torch_mha.fp16"][0] == "failed"
    assert status["torch_mha.fp16"][1] == (
        "torch_mha.fp16: ONNX Runtime was killed by SIGSEGV making a session of this graph (on the CPU, its "
        "default optimizations): a crash inside ONNX Runtime, not an error it reports; not kept"
    )
    assert not (tmp_path / "out" / "torch_mha.fp16.onnx").exists()
    assert onnx.load(tmp_path / "out" / "sdpa.fp16.onnx").graph.node


def test_a_file_that_crashes_onnx_runtime_fails_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A graph from a build folder is data from elsewhere: before a session is made of a file,
    a forked child makes one, so that a crash fails that load, not the process."""
    path = tmp_path / "g.onnx"
    path.write_bytes(_identity())
    load = ort.load_session
    monkeypatch.setattr(ort, "_PROBED", {})
    monkeypatch.setattr(ort, "load_session", lambda *a, **k: os.kill(os.getpid(), signal.SIGSEGV))  # the child's
    with pytest.raises(RuntimeFailure) as e:
        load(path)
    assert str(e.value) == (
        "onnxruntime[cpu]: cannot load g.onnx: ONNX Runtime was killed by SIGSEGV making a session of it (a crash "
        "inside ONNX Runtime, not an error it reports)"
    )
    monkeypatch.setattr(ort, "crash_on_load", lambda *a, **k: pytest.fail("a second child for one file"))
    with pytest.raises(RuntimeFailure):
        load(path)  # told again
    monkeypatch.undo()
    tries: list[object] = []
    monkeypatch.setattr(ort, "crash_on_load", lambda model, *a, **k: tries.append(model))
    load(path)
    load(path)
    load(_identity())  # bytes are this process's own (a graph it made), not probed unless asked
    load(_identity(), probe=True)
    assert tries == [path, _identity()]  # each once a process


def test_verify_of_a_graph_that_crashes_onnx_runtime_fails_it_in_one_line(
    tiny_build: Built, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ort, "_PROBED", {})
    monkeypatch.setattr(ort, "crash_on_load", lambda *a, **k: "was killed by SIGSEGV")
    args = ["verify", str(tiny_build.out), "--models", str(tiny_build.models), "--no-latency"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert "tiny.onnx: ONNX Runtime was killed by SIGSEGV making a session of it" in result.output
    assert "Traceback" not in result.output
