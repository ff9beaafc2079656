"""Where ONNX Runtime ran each node, read from its per-node profile: a real CPU session is
all on the CPU, and nodes off the asked provider split into fallbacks and shape ops."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from attn_export.artifacts.manifest import load_manifest
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.shapes import example_sizes
from attn_export.runtimes import placement
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.placement import OpCount, Placement, placement_from_profile

CPU = "CPUExecutionProvider"


def _runtime(zoo_dir: Path, name: str) -> tuple[OnnxRuntime, dict[str, Any]]:
    entry = load_manifest(zoo_dir).models[name]
    spec = entry.model_spec
    runtime = OnnxRuntime(zoo_dir / entry.file, spec.inputs, spec.outputs, spec.dims)
    return runtime, make_feeds(spec, example_sizes(spec), 0)


def test_a_real_cpu_session_is_placed_all_on_the_cpu_and_leaves_no_profile(
    zoo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runtime, feeds = _runtime(zoo_dir, "mha_kv_cache")  # shape, mask and attention ops alike
    events: list[list[dict[str, Any]]] = []
    real = placement.read_profile
    monkeypatch.setattr(placement, "read_profile", lambda path: events.append(real(path)) or events[-1])
    runtime.activate()
    timed = runtime.session
    found = runtime.placement(feeds)
    assert runtime.active and runtime.session is timed  # a session of its own: the timed one is never profiled
    runtime.deactivate()
    nodes = [e for e in events[0] if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    assert found == Placement(CPU, {CPU: len(nodes)})
    assert len(nodes) > 20 and {e["args"]["op_name"] for e in nodes} >= {"Softmax", "MatMul", "Range", "Equal"}
    assert found.summary() == f"all {len(nodes)} nodes on {CPU}"
    assert os.listdir(tmp_path) == []


def _node(op: str, provider: str, inputs: list[dict[str, list[int]]], outputs: list[dict[str, list[int]]]) -> dict:
    args = {"op_name": op, "provider": provider, "input_type_shape": inputs, "output_type_shape": outputs}
    return {"cat": "Node", "name": f"{op}_{len(inputs)}_kernel_time", "args": args}


def test_nodes_off_the_asked_provider_are_fallbacks_unless_they_only_compute_shapes() -> None:
    events = [
        {"cat": "Session", "name": "model_run", "args": {}},
        _node("MatMul", "CUDAExecutionProvider", [{"float": [2, 3, 8]}], [{"float": [2, 3, 8]}]),
        _node("Attention", CPU, [{"float": [2, 3, 8]}, {"float": [2, 5, 8]}], [{"float": [2, 3, 8]}]),
        _node("Attention", CPU, [{"float": [2, 3, 8]}, {"float": [2, 5, 8]}], [{"float": [2, 3, 8]}]),  # a loop
        _node("Softmax", CPU, [{"float16": [2, 4]}], [{"float16": [2, 4]}]),
        _node("Concat", CPU, [{"int64": [1]}, {"int64": [1]}], [{"int64": [2]}]),
        _node("Cast", CPU, [{"int64": []}], [{"float": []}]),  # a scale computed from a shape
        _node("MatMulInteger", CPU, [{"uint8": [3, 8]}, {"int8": [8, 8]}], [{"int32": [3, 8]}]),
    ]
    found = placement_from_profile(events, "CUDAExecutionProvider")
    assert found.by_provider == {CPU: 5, "CUDAExecutionProvider": 1} and found.nodes == 6
    fell_back = [OpCount("Attention", CPU, 1), OpCount("MatMulInteger", CPU, 1), OpCount("Softmax", CPU, 1)]
    assert found.fallbacks == fell_back
    assert found.shape_ops == [OpCount("Cast", CPU, 1), OpCount("Concat", CPU, 1)]
    assert found.summary() == (
        "6 nodes, asked for CUDAExecutionProvider; fallbacks: Attention x1, MatMulInteger x1, Softmax x1 on "
        f"{CPU}; shape ops: Cast x1, Concat x1 on {CPU}"
    )
    assert Placement.from_dict(found.to_dict()) == found
    empty = placement_from_profile(events[:1], CPU)
    assert (empty.error, empty.nodes) == ("the profile recorded no node", 0)
