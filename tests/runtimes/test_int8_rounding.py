"""The int8 rounding simulated in PyTorch rounds what ``quantize_dynamic`` quantizes, and
nothing else: a MatMul whose second operand is a whole weight of the module. The float16
one stays finite where float16 overflows, and a rounding that cannot run says why."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from attn_export.model_spec import Rounding, TensorSpec
from attn_export.runtimes.int8_rounding import FLOAT16, float16_twin, in_float16, in_int8
from attn_export.runtimes.torch_eager import FLOAT16_ROUNDINGS, TorchRuntime


class _Uses(nn.Module):
    """One weight, used whole, as a chunk, or on another constant of the module."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(torch.randn(24, 8))
        self.latents = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "whole":
            return F.linear(x, self.weight)
        if self.how == "transposed":
            return x @ self.weight.t()
        if self.how == "cut whole":  # a table cut to a length that is all of it: the graph keeps the Slice
            return F.linear(x, self.weight[: x.shape[1] * 5])
        if self.how == "chunk":  # a packed projection cut in three: the graph keeps the Split
            return torch.cat([F.linear(x, w) for w in self.weight.chunk(3)], dim=-1)
        # learned queries: both operands constant, folded into one constant by the export
        return x[..., :4] + F.linear(self.latents, self.weight).sum()


def _changed(how: str) -> bool:
    torch.manual_seed(0)
    module = _Uses(how).eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        return not torch.equal(module(x), in_int8(module, x))


def test_only_a_whole_weight_as_the_second_operand_is_rounded() -> None:
    assert _changed("whole") and _changed("transposed")
    assert not _changed("chunk") and not _changed("cut whole") and not _changed("first")


def test_int4_rounding_is_the_int4_variants_to_float32_noise() -> None:
    """A weight of 70 inputs (blocks of 32, the last one short), rounded in PyTorch as the
    int4 variant's MatMulNBits rounds it, and the activations as accuracy level 4 rounds them
    on a CPU (genai's builder sets it): the same outputs as ONNX Runtime's graph."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from attn_export.exporter.variants.int4 import make

    torch.manual_seed(0)
    linear = nn.Linear(70, 12, bias=False).eval()
    x = torch.randn(3, 70)
    weight = linear.weight.detach().numpy().T.copy()
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 70])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 12])],
        [numpy_helper.from_array(weight, "w")],
    )
    proto = make(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), "cpu").proto
    assert [n.op_type for n in proto.graph.node] == ["MatMulNBits"]
    assert {a.name: a.i for a in proto.graph.node[0].attribute}["accuracy_level"] == 4
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    graph_out = session.run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        simulated = in_int8(linear, x, bits=4).numpy()
        exact = linear(x).numpy()
    assert np.abs(simulated - graph_out).max() < 1e-5 < np.abs(exact - graph_out).max()
    assert onnx.checker.check_model(proto) is None


class _Scores(nn.Module):
    """Attention's scores as the seed module computes them: a MatMul, a scale, Softmax."""

    def __init__(self, fails_in_float16: bool = False) -> None:
        super().__init__()
        self.fails_in_float16 = fails_in_float16
        self.value = nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if self.fails_in_float16 and q.dtype == torch.float16:
            raise RuntimeError("no float16 kernel")
        scores = (q @ k.transpose(-2, -1)) / 2
        return scores.softmax(-1) @ (k * self.value)


def test_float16_that_overflows_keeps_its_float32_result_as_onnx_runtimes_cpu() -> None:
    """Scores past 65504 are +inf in float16; ONNX Runtime's CPU computes them in float32, so
    the simulation keeps them there: finite and as near the module as float16 values allow."""
    torch.manual_seed(0)
    module = _Scores().eval()
    q, k = torch.randn(2, 5, 8) * 200, torch.randn(2, 6, 8) * 200
    assert not torch.isfinite(q.half() @ k.half().transpose(-2, -1)).all()
    with torch.no_grad():
        exact = module(q, k)
        for dither in (None, 1):
            simulated = in_float16(float16_twin(module), q, k, dither=dither)
            assert simulated.dtype == torch.float32 and torch.isfinite(simulated).all()
            assert (simulated - exact).abs().max() < 0.05 * exact.abs().max()


def test_a_rounding_that_cannot_run_says_why() -> None:
    runtime = TorchRuntime(
        _Scores(fails_in_float16=True),
        [TensorSpec("q", "float32", ("b", 5, 8)), TensorSpec("k", "float32", ("b", 6, 8))],
        [TensorSpec("o", "float32", ("b", 5, 8))],
        rounding_bits=(FLOAT16,),
    )
    feeds = {"q": np.ones((1, 5, 8), np.float32), "k": np.ones((1, 6, 8), np.float32)}
    with runtime:
        rounding = runtime.int8_rounding(feeds, runtime.run(feeds))
    assert rounding == {
        "fp16:o": Rounding(unsimulated="fp16's simulation could not run (RuntimeError: no float16 kernel)")
    }


class _TwoKeys(nn.Module):
    """One query over two keys: the output is the second key's share of the Softmax."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q @ k.transpose(-2, -1)).softmax(-1) @ torch.tensor([[0.0], [1.0]], dtype=q.dtype)


def test_fp16_roundings_reach_a_tie_that_the_query_and_keys_rounding_decides() -> None:
    """Scores of 150 made of terms of 30000: a unit of the keys (0.125) moves a score by 25,
    a unit of the score itself by 0.125. A right graph that rounds the keys otherwise gives
    either key the row; the dithered roundings (``FLOAT16_ROUNDINGS``) must reach both ends,
    where dithering the scores alone kept the second key's share within 0.50-0.59."""
    module = _TwoKeys().eval()
    q, k = torch.tensor([[200.0, 199.0]]), torch.tensor([[150.0, -150.0], [150.25, -150.25]])
    twin = float16_twin(module)
    with torch.no_grad():
        shares = [float(in_float16(twin, q, k, scale_scores=s, dither=d)) for s, d in FLOAT16_ROUNDINGS]
    assert float(module(q, k)) == pytest.approx(0.562, abs=1e-3)
    assert min(shares) < 0.01 and max(shares) > 0.99
