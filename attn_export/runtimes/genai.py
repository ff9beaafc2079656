"""onnxruntime-genai's generator as a runtime of whole decoders: greedy tokens and each step's
logits from a folder it loads (``artifacts.genai_folder``), the way a deployment runs them.

It pads a batch's shorter prompts on the right with the config's pad token and masks them,
so each row gives the tokens of its prompt alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attn_export._deps import require
from attn_export.artifacts.json_text import json_text
from attn_export.errors import RuntimeFailure, first_line

__all__ = ["GENAI", "Generation", "genai_generate"]

#: How reports name this runner.
GENAI = "onnxruntime-genai"


@dataclass(frozen=True)
class Generation:
    """Greedy tokens ``tokens[row][step]`` and each step's logits ``logits[step]`` ``[batch, vocab]``
    (of each row's last token): what a generator chose and from what."""

    tokens: list[list[int]]
    logits: list[np.ndarray]
    #: Per step, how far each logit may stray beside the tolerance: where PyTorch's is a
    #: simulated rounding, the spread of its near ties (``checks.generate.torch_generate``).
    room: list[np.ndarray] | None = None


def genai_generate(
    folder: Path, prompts: Sequence[Sequence[int]], steps: int, pad: int, threads: int | None = None
) -> Generation:
    """``steps`` greedy tokens for each prompt, the batch padded on the right with ``pad``, on
    the CPU whatever provider the folder's config names; ``threads`` (verify's) overrides the
    config's intra-op threads for this run, as the other runtimes take it (its float32 sums
    round by the count, which may settle a near tie), the folder left as it is."""
    og = require("onnxruntime_genai", "running onnxruntime-genai's generator")
    longest = max(len(p) for p in prompts)
    batch = np.full((len(prompts), longest), pad, dtype=np.int32)
    for row, prompt in enumerate(prompts):
        batch[row, : len(prompt)] = prompt
    try:
        config = og.Config(str(folder))
        config.clear_providers()
        if threads:
            overlay = {"model": {"decoder": {"session_options": _threads(threads)}}}
            config.overlay(json_text(overlay, indent=None, end=""))
        model = og.Model(config)
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=longest + steps, batch_size=len(prompts))
        generator = og.Generator(model, params)
        generator.append_tokens(batch)
        tokens: list[list[int]] = []
        logits: list[np.ndarray] = []
        while not generator.is_done() and len(tokens) < steps:
            # the logits the search is about to choose from: each row's last token, not a pad after it
            logits.append(np.asarray(generator.get_logits()).reshape(len(prompts), -1).astype(np.float64))
            generator.generate_next_token()
            tokens.append([int(t) for t in generator.get_next_tokens()])
    except Exception as e:  # the generator raises RuntimeError for every refusal
        raise RuntimeFailure(f"onnxruntime-genai: {first_line(e)}") from e
    return Generation([list(row) for row in zip(*tokens, strict=True)], logits)


def _threads(threads: int) -> dict[str, int]:
    """The session options that run each of genai's sessions on ``threads`` intra-op threads."""
    return {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
