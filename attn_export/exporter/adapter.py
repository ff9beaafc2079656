"""Call a module the way its spec says, so library layers need no hand-written wrapper.

The spec's tensors stay the graph's only inputs and outputs; around them the adapter
passes inputs by keyword (``arg``), expands a tokenizer's 2-D mask as the model class would
(``expand``), adds forward() keywords from ``[call]`` (plain values, position ids, rotary
embeddings computed from the sequence length inside the graph), and picks outputs from a
tuple or a model-output object by index or name (``pick``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from attn_export.errors import SpecError
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.masks import EXPANSIONS

__all__ = ["SpecCall", "check_call", "needs_adapter", "pick_outputs", "wrap"]


def needs_adapter(spec: ModelSpec) -> bool:
    """Whether the module cannot be called as ``module(*inputs)`` with its outputs in order."""
    return (
        bool(spec.call) or any(t.arg or t.expand for t in spec.inputs) or any(t.pick is not None for t in spec.outputs)
    )


def _pick(result: Any, pick: int | str) -> Any:
    if isinstance(pick, int):
        try:
            return result[pick]
        except (IndexError, KeyError, TypeError):
            n = len(result) if isinstance(result, tuple | list) else 1
            raise SpecError(f"pick = {pick}: the module returned {n} output(s) ({type(result).__name__})") from None
    if hasattr(result, pick):
        return getattr(result, pick)
    if isinstance(result, Mapping) and pick in result:
        return result[pick]
    names = ", ".join(result) if isinstance(result, Mapping) else "no names"
    raise SpecError(f"pick = {pick!r}: the module returned a {type(result).__name__} with {names}")


def pick_outputs(result: Any, picks: list[int | str | None]) -> Any:
    """The outputs the spec names, as a tuple; ``result`` unchanged when no output picks."""
    if all(p is None for p in picks):
        return result
    return tuple(_pick(result, p) for p in picks if p is not None)


class SpecCall(torch.nn.Module):
    """The spec's module inside an nn.Module whose forward takes the spec's inputs in order."""

    def __init__(
        self,
        module: torch.nn.Module,
        spec: ModelSpec,
        rotary: dict[str, torch.nn.Module],
        expanders: dict[str, Callable[..., Any]],
        config: Any,
    ) -> None:
        super().__init__()
        self.module = module
        self.rotary = torch.nn.ModuleDict(rotary)
        self.spec = spec
        self.expanders = expanders
        self.config = config

    def _expanded(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Each mask with ``expand`` made by the transformers function the model class calls."""
        inputs = self.spec.inputs
        embeds = next(x for t, x in zip(inputs, tensors, strict=True) if x.is_floating_point() and t.mask is None)
        return tuple(
            self.expanders[t.name](config=self.config, inputs_embeds=embeds, attention_mask=x, past_key_values=None)
            if t.name in self.expanders
            else x
            for t, x in zip(inputs, tensors, strict=True)
        )

    def forward(self, *tensors: torch.Tensor) -> Any:
        inputs = self.spec.inputs
        if self.expanders:
            tensors = self._expanded(tensors)
        by_name = {t.name: x for t, x in zip(inputs, tensors, strict=True)}
        args = [x for t, x in zip(inputs, tensors, strict=True) if t.arg is None]
        kwargs: dict[str, Any] = {t.arg: x for t, x in zip(inputs, tensors, strict=True) if t.arg is not None}
        for key, how in self.spec.call.items():
            if not isinstance(how, dict):
                kwargs[key] = how
                continue
            x = by_name[how["positions_of"]]
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)
            kwargs[key] = self.rotary[key](x, positions) if key in self.rotary else positions
        return pick_outputs(self.module(*args, **kwargs), [t.pick for t in self.spec.outputs])


def _ordinal(i: int) -> str:
    return f"{i + 1}{'st' if i == 0 else 'nd' if i == 1 else 'rd' if i == 2 else 'th'}"


def check_call(module: torch.nn.Module, spec: ModelSpec) -> None:
    """SpecError unless ``module.forward`` takes the spec's inputs as the spec passes them:
    in order, but those with ``arg`` and ``[call]``'s, which go by keyword. Left unchecked,
    an input missing or out of order fails deep in the export with a message about another
    input, or exports a graph that feeds the mask where the positions go."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return  # a forward Python cannot describe: the export judges the call
    positional = [t.name for t in spec.inputs if t.arg is None]
    keywords = [t.arg for t in spec.inputs if t.arg is not None] + list(spec.call)
    names = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, name in enumerate(positional):
        if name in names and i < len(names) and names.index(name) != i:
            raise SpecError(
                f"{spec.name}: input '{name}' is listed {_ordinal(i)}, so it is passed as forward's parameter "
                f"'{names[i]}', but forward takes '{name}' {_ordinal(names.index(name))}: list the inputs in "
                f'forward\'s order, or set arg = "{name}" on it'
            )
    try:
        signature.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as e:
        by_keyword = f" and {', '.join(keywords)} by keyword" if keywords else ""
        raise SpecError(
            f"{spec.name}: {type(module).__name__}.forward({', '.join(signature.parameters)}) does not take the "
            f"spec's inputs, passed as {', '.join(positional)} in order{by_keyword}: {e}"
        ) from None


def wrap(module: torch.nn.Module, spec: ModelSpec, config: Any, resolve: Callable[[str], Any]) -> torch.nn.Module:
    """``module`` called as ``spec`` says; rotary modules are built from the spec's config."""
    check_call(module, spec)
    if not needs_adapter(spec):
        return module
    rotary = {
        key: resolve(how["rotary"])(**({"config": config} if config is not None else {}))
        for key, how in spec.call.items()
        if isinstance(how, dict) and "rotary" in how
    }
    expanders = {t.name: resolve(EXPANSIONS[t.expand]) for t in spec.inputs if t.expand}
    if expanders and not any(t.mask is None and t.dtype.startswith("float") for t in spec.inputs):
        raise SpecError(f"{spec.name}: expand needs a floating input (the hidden states) to size the mask from")
    return _with_arity(len(spec.inputs))(module, spec, rotary, expanders, config).eval()


def _with_arity(n: int) -> type[SpecCall]:
    """SpecCall whose forward declares ``n`` positional inputs, as torch.export matches
    dynamic shapes to parameters (``*tensors`` would be one)."""

    def forward(self: SpecCall, *tensors: torch.Tensor) -> Any:
        return SpecCall.forward(self, *tensors)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", kind), *(inspect.Parameter(f"input_{i}", kind) for i in range(n))]
    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return type("SpecCall", (SpecCall,), {"forward": forward})
