"""Latency figures that can be trusted: noise is flagged and decides nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest

from attn_export.compare import compare_output
from attn_export.compare.latency import clearly_faster, latency_gate, noise
from attn_export.errors import RuntimeFailure
from attn_export.model_spec import Tolerance
from attn_export.pipelines.verify import CaseResult, ModelCheck, VerifyReport
from attn_export.runtimes import Target
from attn_export.runtimes.timing import LatencyStats, first_calls, measure_alternating


def _stats(p50: float, p90: float, load: float | None = 0.1, cores: int = 2) -> LatencyStats:
    return LatencyStats(p50, p90, p50, 100, load, cores)


def test_noise_is_a_wide_spread_or_a_machine_busier_than_its_cores() -> None:
    assert noise(_stats(1.0, 1.2)) is None
    assert noise(_stats(1.0, 2.0)) == "noisy (p90 is 2.0x p50), rerun"
    assert noise(_stats(1.0, 1.1, load=3.5)) == "noisy (load average 3.5 above 2 cores), rerun"
    assert noise(_stats(1.0, 1.1, load=None)) is None  # no load average on this OS: judge the spread only


def test_the_slowdown_gate_decides_only_beyond_the_noise() -> None:
    fast = _stats(1.0, 1.1)
    assert latency_gate(_stats(3.0, 3.2), fast, 2.0) is not None  # 3x, and beyond PyTorch's slow runs
    assert latency_gate(_stats(2.5, 2.7), _stats(1.0, 1.5), 2.0) is None  # 2.5x, but within PyTorch's spread
    case = CaseResult("m", Target("onnxruntime", "cpu"), "min", {}, 0, "torch[cpu]")
    case.comparisons = [compare_output("y", np.ones(2, np.float32), np.ones(2, np.float32), Tolerance(1e-5, 1e-4))]
    case.onnx_latency, case.torch_latency = _stats(2.5, 2.7), _stats(1.0, 1.6)
    report = VerifyReport("out", 0, {}, [ModelCheck("m", "m.onnx")], [case])
    assert case.passed and report.summary["noisy_timings"] == 1
    assert report.to_dict()["cases"][0]["latency"]["noise"] == "noisy (p90 is 1.6x p50), rerun"


def test_a_difference_inside_the_noise_is_no_win() -> None:
    assert clearly_faster(_stats(1.0, 1.1), _stats(1.5, 1.6))
    assert not clearly_faster(_stats(0.99, 1.2), _stats(1.0, 1.1))  # 1% faster: within the noise


def test_alternating_blocks_time_every_call_in_turns() -> None:
    order: list[str] = []

    def call(name: str, seconds: float):
        def run() -> None:
            order.append(name)
            time.sleep(seconds)

        return run

    stats = measure_alternating({"a": call("a", 0.001), "b": call("b", 0.002)}, budget_s=0.04, blocks=4, warmup=1)
    assert set(stats) == {"a", "b"} and stats["a"].p50_ms < stats["b"].p50_ms
    switches = sum(x != y for x, y in zip(order, order[1:], strict=False))
    assert switches >= 2 * 4 - 1  # a, b, a, b, ... block by block, not all of a then all of b


def test_first_calls_count_only_the_calls_that_compiled_and_stop_once_a_round_compiles_nothing() -> None:
    graphs = [0]
    calls: list[int] = []

    def call(k: int):
        def run() -> None:
            calls.append(k)
            if len(calls) <= 4 and k == 1:  # the second call compiles, in rounds one and two only
                graphs[0] += 1
                time.sleep(0.05)

        return run

    spent = first_calls([call(0), call(1)], lambda: graphs[0])
    assert calls == [0, 1, 0, 1, 0, 1]  # round three compiled nothing: warm
    assert 0.1 <= spent < 0.2  # the two compiling calls, not the four others


def test_first_calls_refuse_a_compiler_that_never_settles() -> None:
    graphs = [0]

    def compiles() -> None:
        graphs[0] += 1

    with pytest.raises(RuntimeFailure, match="^still compiling after 3 rounds of the same 1 calls$"):
        first_calls([compiles], lambda: graphs[0], rounds=3)
