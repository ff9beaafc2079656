"""localize's and replay's verdicts print recorded text (source lines, names a graph or a
bundle carries) escaped: it is data, and a line break or a terminal escape in it must not
clear the screen or forge a line of the verdict."""

from __future__ import annotations

import numpy as np

from attn_export.compare.outputs import judge_value
from attn_export.model_spec import Tolerance
from attn_export.pipelines.localize import LocalizeReport, RegionError
from attn_export.report.localize_text import format_localize

FORGED = "y = x\x1b[2J\nAGREES: the graph gives PyTorch's outputs here"


def test_recorded_text_is_printed_escaped_one_line_each() -> None:
    tol = Tolerance(atol=1e-5, rtol=1e-4)
    wrong = judge_value("output", np.zeros(4, np.float32), np.ones(4, np.float32), tol)
    region = RegionError(
        fx_node="add\x07", value="add", nodes=["node_add"], ops=["Add"], target="aten.add.Tensor",
        module_path="m", source="m.py:3", code=FORGED, local=wrong, propagated=wrong,
    )  # fmt: skip
    report = LocalizeReport(
        model="m", file="m.onnx", sizes={"batch": 1}, seed=0, distribution="normal", mask_case=None,
        provider="cpu", outputs=[wrong], regions=[region], uncompared=0, first=region, cause="graph",
    )  # fmt: skip
    lines = format_localize(report).splitlines()
    assert [line for line in lines if "AGREES" in line] == [
        "DIVERGES first at ONNX node_add [Add] from FX node add\\x07 (aten.add.Tensor) in m at m.py:3 "
        "`y = x\\x1b[2J\\nAGREES: the graph gives PyTorch's outputs here`"
    ]
    assert all(line.isprintable() for line in lines)
