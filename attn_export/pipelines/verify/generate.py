"""``verify --generate N``: each causal LM's graph generates N greedy tokens from seeded
prompts on each ONNX Runtime target (our loop) and, where onnxruntime-genai is installed and
the graph fits it, in genai's generator; PyTorch's ``generate()`` is the reference
(``checks.generate``)."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from attn_export.artifacts.genai_folder import refuse_unfit, write_genai_folder
from attn_export.artifacts.manifest import ManifestEntry
from attn_export.checks.generate import (
    GenerateResult,
    eos_tokens,
    generate_prompts,
    graph_generate,
    judge,
    stacked,
    torch_generate,
)
from attn_export.errors import SpecError
from attn_export.pipelines.verify.expected import tolerances_for
from attn_export.pipelines.verify.results import VerifyOptions
from attn_export.runtimes import RUNTIMES
from attn_export.runtimes.genai import Generation
from attn_export.spec import ModelSpec, Tolerance
from attn_export.spec.memory import memory_budget

__all__ = ["generate_model"]

GENAI = "onnxruntime-genai"


def _pad(config: Any) -> int:
    """The token a padded prompt is filled with: the config's pad token, else its end of
    sequence, else 0 (the mask hides it either way)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            return value
    return 0


def _result(
    name: str,
    runner: str,
    layout: str,
    prompts: list[list[int]],
    steps: int,
    want: Generation,
    got: Generation,
    tolerance: Tolerance,
    eos: frozenset[int],
) -> GenerateResult:
    by_step, divergence, step = judge(want, got, tolerance, eos)
    return GenerateResult(name, runner, layout, prompts, steps, want.tokens, got.tokens, by_step, divergence, step)


def _fits_genai(spec: ModelSpec, variant: str) -> bool:
    try:
        refuse_unfit(spec, variant)
    except SpecError:
        return False
    return importlib.util.find_spec("onnxruntime_genai") is not None


def generate_model(
    out_dir: Path, entry: ManifestEntry, spec: ModelSpec, options: VerifyOptions
) -> list[GenerateResult]:
    """Every generation of ``entry``'s graph this run asks for, judged against PyTorch."""
    from attn_export.exporter.factory import build_config, instantiate

    steps = options.generate_steps
    prompts = generate_prompts(spec, steps, options.seed)
    module = instantiate(spec)
    config = build_config(spec)
    pad, eos = _pad(config), eos_tokens(config)
    tolerance = tolerances_for(spec, entry.variant, options)["logits"]
    graph = out_dir / entry.file
    # a quantized graph generates as the module with its weights rounded so
    judged = spec.tolerance_for("logits", entry.variant)
    bits = judged.weight_bits if judged.int8_rounding else None
    expected = {layout: torch_generate(module, spec, rows, steps, pad, bits) for layout, rows in prompts.items()}
    results = []
    for target in options.targets:
        if target.runtime != "onnxruntime":
            continue
        budget = memory_budget(options.max_memory, spec)
        runtime = RUNTIMES[target.runtime].make(graph, spec, target, options.threads, budget)
        with runtime:
            for layout, rows in prompts.items():
                got = graph_generate(runtime, spec, rows, steps, pad)
                results.append(
                    _result(entry.name, target.label, layout, rows, steps, expected[layout], got, tolerance, eos)
                )
    if _fits_genai(spec, entry.variant):
        from attn_export.runtimes.genai import genai_generate

        with tempfile.TemporaryDirectory(prefix="attn-export-genai-") as tmp:
            folder = write_genai_folder(graph, spec, config, Path(tmp) / "model", entry.variant)
            for layout, rows in prompts.items():
                # genai pads on the right and masks: each row gives what its prompt alone gives
                want = stacked([torch_generate(module, spec, [row], steps, pad, bits) for row in rows])
                got = genai_generate(folder, rows, steps, pad)
                results.append(_result(entry.name, GENAI, layout, rows, steps, want, got, tolerance, eos))
    return results
