"""The inputs of one step of ``verify --generate``'s generation, for ``localize
--generate-step``: the seeded prompts verify drew, with PyTorch's own tokens and cache fed
back before the step, so that the step is localized on PyTorch's inputs and only its own
divergence shows (a graph that picked another token earlier is not followed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from attn_export.artifacts.genai_folder import logits_vocab, pad_token, special_tokens
from attn_export.checks.generate import Side, generate_prompts, graph_generate, step_feeds, uneven
from attn_export.errors import NotLocalizable, OptionError
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.shapes import sizes_from_feeds
from attn_export.pipelines.localize.results import LocalizeOptions
from attn_export.runtimes.torch_eager import TorchRuntime

__all__ = ["generate_step_case"]


def generate_step_case(
    spec: ModelSpec,
    module: Any,
    options: LocalizeOptions,
    bits: int | None,
    side: Side | None = "left",
    activations: bool = True,
) -> tuple[dict[str, int], dict[str, np.ndarray], str]:
    """The sizes and feeds of generation step ``options.generate_step`` (1 = the prompt) of
    the ``options.layout`` prompts of a ``--generate options.generate_steps`` run, and that
    layout; the module runs with the variant's weight rounding ``bits`` (8, 4, or None), as
    verify's reference generation does (int4 without ``activations``: its weights alone).
    Prompts of different lengths are padded on ``side``
    (``padding_side``); NotLocalizable where it is not the left: the module pads a cache
    where its mask says, a graph padded on the right keeps each row's tokens first, and fed
    the module's cache it would read the pads (None: the graph takes no padding)."""
    from attn_export.exporter.factory import build_config

    step, steps = options.generate_step or 0, options.generate_steps
    if not 1 <= step <= steps:
        outside = f"{{model}}: {{generate_step}} {step} is not a step of {{generate_steps}} {steps} (1 to {steps})"
        raise OptionError(outside, ["generate_step", "generate_steps"], model=spec.name)
    config = build_config(spec)
    vocab = logits_vocab(spec)
    pad = pad_token(config, vocab)
    prompts = generate_prompts(spec, steps, options.seed, special_tokens(config, vocab))
    layout = options.layout or next(iter(prompts))
    if layout not in prompts:
        has = ", ".join(prompts)
        unknown = f"{{model}}: {{layout}} {{value}} is not a generation layout (it has: {has})"
        raise OptionError(unknown, ["layout"], model=spec.name, value=layout)
    rows = prompts[layout]
    if uneven(rows) and side != "left":
        takes = "takes padded on the right, its cache laid out as the module's is not" if side else "takes no padding"
        raise NotLocalizable(
            f"{spec.name}: the {layout} generation's prompts are of different lengths, which the graph {takes}: "
            f"localize a layout of prompts of one length ({' or '.join(_even(prompts))})"
        )
    with TorchRuntime(
        module, spec.inputs, spec.outputs, spec.dims, weight_bits=bits, int4_activations=activations
    ) as eager:
        tokens = graph_generate(eager, spec, rows, step - 1, pad).tokens or [[] for _ in rows]
        feeds = step_feeds(eager, spec, rows, tokens, pad, step)
    sizes = sizes_from_feeds(spec.inputs, {name: value.shape for name, value in feeds.items()})
    return spec.with_sums(sizes), feeds, layout


def _even(prompts: dict[str, list[list[int]]]) -> list[str]:
    """The layouts whose prompts are of one length."""
    return [layout for layout, rows in prompts.items() if not uneven(rows)]
