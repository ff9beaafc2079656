"""Verify judges real value distributions, refuses random or training-mode graphs, and
takes a user's recorded inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from attn_export.cli import cli
from attn_export.model_spec import load_spec
from attn_export.model_spec.distributions import DISTRIBUTIONS
from attn_export.model_spec.inputs import make_feeds
from tests.conftest import Built, plant

FAST = ("--no-latency",)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def tiny(tiny_build: Built) -> tuple[Path, Path]:
    """A copy of a build of ``tiny_spec``: its spec folder and its build folder."""
    return tiny_build.models, tiny_build.out


def _verify(tiny: tuple[Path, Path], *extra: str):
    models, out = tiny
    return invoke("verify", str(out), "--models", str(models), *FAST, *extra)


def test_distributions_are_what_their_names_say() -> None:
    rng = np.random.default_rng(0)
    shape = (4, 64, 32)
    normal = DISTRIBUTIONS["normal"][0](rng, shape)
    assert 0.9 < normal.std() < 1.1
    assert 90 < DISTRIBUTIONS["large"][0](rng, shape).std() < 110
    assert DISTRIBUTIONS["tiny"][0](rng, shape).std() < 2e-3
    outliers = DISTRIBUTIONS["outliers"][0](rng, shape)
    channel_scale = np.abs(outliers).reshape(-1, 32).max(axis=0)
    big = channel_scale > 20
    assert 1 <= big.sum() <= 4 and np.median(channel_scale[~big]) < 6


def _clip_query(proto: onnx.ModelProto, limit: float) -> onnx.ModelProto:
    """Clip the query input to +-limit before anything reads it: right for unit values,
    wrong for large ones (a saturating op that hides)."""
    graph = proto.graph
    for n in graph.node:
        for i, name in enumerate(n.input):
            if name == "query":
                n.input[i] = "query_clipped"
    lo = helper.make_tensor("clip_lo", onnx.TensorProto.FLOAT, [], [-limit])
    hi = helper.make_tensor("clip_hi", onnx.TensorProto.FLOAT, [], [limit])
    graph.initializer.extend([lo, hi])
    graph.node.insert(0, helper.make_node("Clip", ["query", "clip_lo", "clip_hi"], ["query_clipped"]))
    return proto


def test_a_graph_wrong_only_for_large_values_fails_on_those(tiny: tuple[Path, Path]) -> None:
    _, out = tiny
    plant(out, "tiny", _clip_query(onnx.load(out / "tiny.onnx"), 20.0))
    result = _verify(tiny)
    assert result.exit_code == 1
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL ")]
    assert any(" large (seed " in f for f in failures), failures
    assert all(" large (seed " in f or " outliers (seed " in f for f in failures), failures  # never at unit scale
    assert "--distribution large" in result.output  # the reproduce command picks the same values
    normal_rows = [line for line in result.output.splitlines() if line.startswith("tiny ") and " normal " in line]
    assert normal_rows and all(" PASS " in row for row in normal_rows)


def test_golden_verify_also_judges_the_distributions(tiny: tuple[Path, Path]) -> None:
    _, out = tiny
    plant(out, "tiny", _clip_query(onnx.load(out / "tiny.onnx"), 20.0))
    result = invoke("verify", str(out), "--golden", *FAST)
    assert result.exit_code == 1
    assert "FAIL tiny onnxruntime[cpu] distinct large (seed " in result.output


def test_json_report_records_each_case_distribution(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    assert _verify(tiny, "--json", str(report)).exit_code == 0
    cases = json.loads(report.read_text())["cases"]
    assert {c["distribution"] for c in cases} == set(DISTRIBUTIONS)


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (
            helper.make_node("Dropout", ["output_pre", "ratio", "training"], ["output"], name="drop"),
            "Dropout node 'drop' with training_mode = true",
        ),
        (
            helper.make_node("RandomNormalLike", ["output_pre"], ["noise"], name="noise_op"),
            "a random op, RandomNormalLike node 'noise_op'",
        ),
    ],
)
def test_a_random_or_training_mode_node_fails_by_name(tiny: tuple[Path, Path], node, message: str) -> None:
    _, out = tiny
    proto = onnx.load(out / "tiny.onnx")
    graph = proto.graph
    last = next(n for n in graph.node if "output" in n.output)
    last.output[list(last.output).index("output")] = "output_pre"
    graph.initializer.extend(
        [
            helper.make_tensor("ratio", onnx.TensorProto.FLOAT, [], [0.1]),
            helper.make_tensor("training", onnx.TensorProto.BOOL, [], [True]),
        ]
    )
    if node.op_type == "Dropout":
        graph.node.append(node)
    else:
        graph.node.extend([node, helper.make_node("Add", ["output_pre", "noise"], ["output"])])
    plant(out, "tiny", proto)
    for extra in ((), ("--golden",)):
        result = _verify(tiny, *extra)  # --golden ignores the checkout's specs
        assert result.exit_code == 1, result.output
        assert f"FAIL tiny: the graph holds {message}" in result.output


def _recorded(tiny: tuple[Path, Path], path: Path, *, outputs: bool, **override: np.ndarray) -> Path:
    models, _ = tiny
    spec = load_spec(models / "tiny.toml")
    arrays = {}
    for i, sizes in enumerate(({"batch": 1, "seq": 7, "kv_seq": 33}, {"batch": 3, "seq": 2, "kv_seq": 2})):
        feeds = {**make_feeds(spec, sizes, 100 + i, distribution="outliers"), **override}
        arrays.update({f"act{i}/inputs/{k}": v for k, v in feeds.items()})
        if outputs:
            from attn_export.exporter.factory import instantiate
            from attn_export.runtimes.torch_eager import TorchRuntime

            with TorchRuntime(instantiate(spec), spec.inputs, spec.outputs) as eager:
                arrays.update({f"act{i}/outputs/{k}": v for k, v in eager.run(feeds).items()})
    np.savez(path, **arrays)
    return path


def test_recorded_inputs_verify_against_pytorch_and_in_golden_mode(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    _, out = tiny
    path = _recorded(tiny, tmp_path / "acts.npz", outputs=True)
    result = _verify(tiny, "--inputs", str(path))
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("tiny ")]
    assert len(rows) == 2 and all(" recorded " in r for r in rows)
    golden = invoke("verify", str(out), "--golden", "--inputs", str(path), *FAST)
    assert golden.exit_code == 0, golden.output


def test_recorded_inputs_that_do_not_fit_are_one_line(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    _, out = tiny
    no_outputs = _recorded(tiny, tmp_path / "a.npz", outputs=False)
    result = invoke("verify", str(out), "--golden", "--inputs", str(no_outputs), *FAST)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1].startswith(f"Error: {no_outputs}: case 'act0' holds no expected outputs")
    np.savez(tmp_path / "b.npz", query=np.zeros((1, 3, 16), np.float32))
    result = _verify(tiny, "--inputs", str(tmp_path / "b.npz"))
    assert result.exit_code == 2
    assert "case 'recorded': feeds do not match the inputs ['query', 'keys', 'values']: missing" in result.output
