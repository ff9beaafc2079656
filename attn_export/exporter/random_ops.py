"""A module that draws random numbers in eval mode cannot be the reference, and the exported
graph does not show it: the exporter drops SDPA's ``dropout_p`` outside training, so the
graph is deterministic while PyTorch is not. Two runs of the module that differ catch a
large dropout, but a small one (``dropout_p=1e-6``) agrees with itself most of the time,
and then verify passed or failed by chance. So the FX program the graph was made from is
read instead: every op torch tags as drawing from its random generator is refused, with its
source line, unless its own arguments switch the draw off (a dropout probability of 0, or
a dropout outside training).
"""

from __future__ import annotations

from typing import Any

from attn_export.errors import NondeterministicModule
from attn_export.exporter.stack import innermost_line

__all__ = ["refuse_random_ops"]


#: Arguments that switch an op's draw off: training flags when False, dropout probabilities
#: when 0 (``p`` only beside a training flag: bernoulli's ``p`` is what it draws).
_SWITCHES = ("train", "training")
_PROBABILITIES = ("dropout_p", "dropout")


def _arguments(node: Any) -> dict[str, object]:
    """``node``'s arguments by name, given or defaulted."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _draw(node: Any) -> tuple[str, str] | None:
    """Why ``node`` draws random numbers when the module runs, and what to do instead; None
    where it does not. A flag or probability computed in the graph counts as off: two runs
    of the module still judge it."""
    import torch

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return None
    args = _arguments(node)
    switch = next((n for n in _SWITCHES if n in args), None)
    if switch is not None and args[switch] not in (True, None):  # an optional flag left None means on
        return None
    chance = next((n for n in _PROBABILITIES if n in args), "p" if switch and "p" in args else None)
    if chance is not None:
        value = args[chance]
        if not (isinstance(value, int | float) and value > 0):
            return None
    why = ", ".join(f"{n}={args[n]}" for n in (chance, switch) if n is not None) or "a random draw"
    if chance == "dropout_p":
        return why, "pass dropout_p=(p if self.training else 0.0)"
    if switch is not None:
        return why, f"pass {switch}=self.training"
    return why, "take the random values as an input instead"


def refuse_random_ops(program: Any, model: str) -> None:
    """``NondeterministicModule`` naming the first op of ``program`` (a torch.export
    ExportedProgram) that makes the module random in eval mode, and its source line."""
    for node in program.graph.nodes:
        found = _draw(node)
        if found is None:
            continue
        why, instead = found
        line = innermost_line(node.meta.get("stack_trace") or "")
        where = f" at {line[0]} `{line[1]}`" if line else ""
        raise NondeterministicModule(
            f"{model}: the module is random in eval mode: {node.target.name()} ({why}){where} draws new numbers "
            f"on every call, so PyTorch cannot be the reference; {instead}"
        )
