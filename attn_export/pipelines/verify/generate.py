"""``verify --generate N``: each causal LM's graph generates N greedy tokens from seeded
prompts on each ONNX Runtime target (our loop) and, where onnxruntime-genai is installed and
the graph fits it, in genai's generator; PyTorch's ``generate()`` is the reference
(``checks.generate``)."""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attn_export.artifacts.genai_folder import (
    eos_tokens,
    genai_config,
    pad_token,
    special_tokens,
    write_genai_folder,
)
from attn_export.artifacts.manifest import ManifestEntry
from attn_export.checks.generate import (
    GenerateResult,
    generate_prompts,
    graph_generate,
    judge,
    stacked,
    torch_generate,
)
from attn_export.errors import AttnExportError, SpecError
from attn_export.exporter.variants.static_cache import fed_by_genai
from attn_export.pipelines.verify.expected import tolerances_for
from attn_export.pipelines.verify.results import VerifyOptions
from attn_export.runtimes import RUNTIMES
from attn_export.runtimes.genai import GENAI, Generation
from attn_export.spec import ModelSpec
from attn_export.spec.memory import memory_budget

__all__ = ["generate_model"]


def _fits_genai(spec: ModelSpec, variant: str, config: Any) -> bool:
    """Whether genai's generator can run the graph: installed, and the graph fits it."""
    try:
        genai_config(spec, config, variant)
    except SpecError:
        return False
    return importlib.util.find_spec("onnxruntime_genai") is not None


def _run(make: Callable[..., Generation], *args: Any) -> Generation | str:
    """A runner's generation, or why it could not run (a FAIL row, not the end of the report)."""
    try:
        return make(*args)
    except AttnExportError as e:
        return f"the graph's runner failed: {e}"


def generate_model(
    out_dir: Path, entry: ManifestEntry, spec: ModelSpec, options: VerifyOptions
) -> list[GenerateResult]:
    """Every generation of ``entry``'s graph this run asks for, judged against PyTorch."""
    from attn_export.exporter.factory import build_config, instantiate

    config = build_config(spec)
    pad, eos = pad_token(config), eos_tokens(config)
    steps = options.generate_steps
    prompts = generate_prompts(spec, steps, options.seed, special_tokens(config))
    module = instantiate(spec)
    judged = spec.tolerance_for("logits", entry.variant)
    # a quantized graph generates as the module with its weights rounded so; int4's rounding is
    # simulated to float32 noise, so its logits are held to the model's own tolerance
    bits = judged.weight_bits if judged.int8_rounding and judged.weight_bits in (8, 4) else None
    tolerance = tolerances_for(spec, "fp32" if bits == 4 else entry.variant, options)["logits"]
    graph = out_dir / entry.file
    expected = {layout: torch_generate(module, spec, rows, steps, pad, bits) for layout, rows in prompts.items()}
    results = []

    def judged_row(runner: str, layout: str, rows: list[list[int]], want: Generation, got: Generation | str) -> None:
        """The row of one runner's generation; one that could not run diverges at its first step."""
        by_step: list[float] = []
        step: int | None = 1
        tokens: list[list[int]] = []
        if isinstance(got, str):
            divergence = got
        else:
            (by_step, divergence, step), tokens = judge(want, got, tolerance, eos), got.tokens
        results.append(
            GenerateResult(entry.name, runner, layout, rows, steps, want.tokens, tokens, by_step, divergence, step)
        )

    for target in options.targets:
        if target.runtime != "onnxruntime":
            continue
        budget = memory_budget(options.max_memory, spec)
        with RUNTIMES[target.runtime].make(graph, spec, target, options.threads, budget) as runtime:
            for layout, rows in prompts.items():
                got = _run(graph_generate, runtime, spec, rows, steps, pad)
                judged_row(target.label, layout, rows, expected[layout], got)
    if _fits_genai(spec, entry.variant, config):
        from attn_export.runtimes.genai import genai_generate

        with tempfile.TemporaryDirectory(prefix="attn-export-genai-") as tmp:
            edit = fed_by_genai(entry.variant)
            folder = write_genai_folder(graph, spec, config, Path(tmp) / "model", entry.variant, edit)
            for layout, rows in prompts.items():
                # genai pads on the right and masks: each row gives what its prompt alone gives
                want = stacked([torch_generate(module, spec, [row], steps, pad, bits) for row in rows])
                judged_row(GENAI, layout, rows, want, _run(genai_generate, folder, rows, steps, pad))
    return results
