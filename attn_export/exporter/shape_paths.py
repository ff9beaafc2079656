"""Which source lines the module's Python runs at one set of sizes, and where two sets differ.

torch.export decides a comparison of a size with 0 or 1 (``if past.shape[2] == 0:``) by
assuming sizes are at least 2, and adds no guard: the graph keeps the example's path for
every size of the range, and is wrong wherever the module takes the other one. The graph
cannot show that; two traces can. Each trace is static (sizes fixed, fake tensors, no
allocation), and records the innermost source line outside torch of every op it runs; the
lines run at one set of sizes and not at the other are the branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attn_export._deps import require
from attn_export.exporter.stack import innermost_line
from attn_export.exporter.torch_export import quieted
from attn_export.model_spec import Guard, ModelSpec
from attn_export.model_spec.shapes import format_sizes

__all__ = ["PathDifference", "path_difference", "traced_lines"]

#: Ops the tracer leaves out when they would do nothing at these sizes (a contiguous copy of
#: a tensor with a dim of 1, a slice over a whole dim): not a change of path.
_NO_OPS = ("aten.contiguous", "aten.clone", "aten.alias", "aten.detach", "aten.slice", "aten._assert")


def traced_lines(module: Any, spec: ModelSpec, feeds: Mapping[str, np.ndarray]) -> dict[str, str]:
    """``{"file:line": text}`` of every source line outside torch that puts an op in a static
    torch.export trace of ``module`` at these feeds' sizes, in the order first run."""
    torch = require("torch", "tracing the module")
    args = tuple(torch.from_numpy(np.ascontiguousarray(feeds[t.name])) for t in spec.inputs)
    with torch.no_grad(), quieted("", ()):  # torch's tracer prints what it cannot place
        program = torch.export.export(module, args, strict=False)
    lines: dict[str, str] = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or str(node.target).startswith(_NO_OPS):
            continue
        found = innermost_line(node.meta.get("stack_trace") or "")
        if found:
            lines.setdefault(*found)
    return lines


@dataclass(frozen=True)
class PathDifference:
    """Source lines run at the example's sizes only, and at ``sizes`` only."""

    sizes: dict[str, int]
    only_example: dict[str, str]
    only_here: dict[str, str]
    #: The guards the spec accepted that fail at ``sizes``: where the export knew it.
    guards: tuple[Guard, ...] = ()

    def describe(self) -> str:
        def show(lines: dict[str, str]) -> str:
            shown = [f"{where} `{text}`" if text else where for where, text in list(lines.items())[:3]]
            return "; ".join(shown) + (f" and {len(lines) - 3} more" if len(lines) > 3 else "")

        parts = []
        if self.only_example:
            parts.append(f"only at the example: {show(self.only_example)}")
        if self.only_here:
            parts.append(f"only at these sizes: {show(self.only_here)}")
        known = (
            f"where the spec accepted the guard {'; '.join(g.describe() for g in self.guards)}"
            if self.guards
            else "and torch.export kept the example's without a guard"
        )
        return (
            f"the module's Python takes another path at {format_sizes(self.sizes)} than at the example the graph "
            f"was exported at, {known} ({', '.join(parts)}); "
            "make that code independent of the sizes, or narrow [dims] to leave these sizes out"
        )


def path_difference(
    module: Any,
    spec: ModelSpec,
    example: Mapping[str, np.ndarray],
    feeds: Mapping[str, np.ndarray],
    sizes: Mapping[str, int],
) -> PathDifference | None:
    """Where the module's path at ``feeds`` (of ``sizes``) leaves its path at ``example``;
    None when both run the same lines, or when the module cannot be traced at one of them.
    The spec's accepted guards that fail at ``sizes`` are named as the known cause."""
    try:
        at_example, here = traced_lines(module, spec, example), traced_lines(module, spec, feeds)
    except Exception:  # noqa: BLE001 - a module that torch.export cannot trace has no path to compare
        return None
    only_example = {k: v for k, v in at_example.items() if k not in here}
    only_here = {k: v for k, v in here.items() if k not in at_example}
    if not only_example and not only_here:
        return None
    return PathDifference(dict(sizes), only_example, only_here, tuple(g for g in spec.guards if g.fails_at(sizes)))
