"""``verify --generate N``: each causal LM's graph generates N greedy tokens from seeded
prompts on each ONNX Runtime target (our loop) and, where onnxruntime-genai is installed and
the graph fits it, in genai's generator; PyTorch's ``generate()`` is the reference
(``checks.generate``), run here or, in golden mode, recorded at build
(``artifacts.generations``: no torch). genai runs the folder the build wrote for the graph
(``build --target genai``: what a user ships), held to the hashes the manifest records, else
one made here from the graph."""

from __future__ import annotations

import functools
import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attn_export.artifacts.genai_folder import (
    GENAI_DIR,
    eos_tokens,
    genai_config,
    logits_vocab,
    pad_token,
    right_padded_window,
    special_tokens,
    write_genai_folder,
)
from attn_export.artifacts.generations import read_generations
from attn_export.artifacts.manifest import ManifestEntry
from attn_export.artifacts.onnx_file import load_model_file
from attn_export.checks.generate import (
    GenerateResult,
    Judged,
    generate_prompts,
    graph_generate,
    judge,
    padding_side,
    stacked,
    torch_generate,
    uneven,
)
from attn_export.errors import ArtifactError, AttnExportError, OptionError, SpecError
from attn_export.exporter.variants.static_cache import fed_by_genai
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.cache import short_window
from attn_export.model_spec.memory import memory_budget
from attn_export.model_spec.tolerance import Tolerance, rounding_name
from attn_export.pipelines.verify.expected import int4_activations, target_tolerances
from attn_export.pipelines.verify.models import genai_integrity, integrity
from attn_export.pipelines.verify.results import VerifyOptions
from attn_export.runtimes import RUNTIMES, Target
from attn_export.runtimes.genai import GENAI, Generation
from attn_export.runtimes.ort import KIND as ORT_KIND

__all__ = ["generate_model", "generation_rounding", "recorded_reference"]


def _run(make: Callable[..., Generation], *args: Any) -> Generation | str:
    """A runner's generation, or why it could not run (a FAIL row, not the end of the report)."""
    try:
        return make(*args)
    except AttnExportError as e:
        return f"the graph's runner failed: {e}"


@dataclass(frozen=True)
class _Reference:
    """What a run's generations are judged against: the prompts by layout, the pad and end
    tokens, PyTorch's generation of each layout run as one batch (``batch``) or each prompt
    alone (``alone``)."""

    prompts: dict[str, list[list[int]]]
    pad: int
    eos: frozenset[int]
    generation: Callable[[str, str], Generation]


#: Where genai's generator runs a graph: ONNX Runtime's CPU provider.
GENAI_CPU = Target(ORT_KIND.name, "cpu")


def generation_rounding(spec: ModelSpec, variant: str) -> int | None:
    """The weight rounding a ``variant`` graph generates by (8, 4), or None: a quantized graph
    generates as the module with its weights rounded so."""
    judged = spec.tolerance_for("logits", variant)
    return judged.weight_bits if judged.int8_rounding and judged.weight_bits in (8, 4) else None


def _from_torch(spec: ModelSpec, options: VerifyOptions, bits: int | None, activations: bool = True) -> _Reference:
    """PyTorch's ``generate()`` of seeded prompts, on this machine (int4 without
    ``activations``: its weights alone rounded, as a CPU computes MatMulNBits in float)."""
    from attn_export.exporter.factory import build_config, instantiate

    config = build_config(spec)
    vocab = logits_vocab(spec)
    pad = pad_token(config, vocab)
    steps = options.generate_steps
    prompts = generate_prompts(spec, steps, options.seed, special_tokens(config, vocab))
    module = instantiate(spec)

    @functools.cache  # greedy and seeded: each target and runner judged by one run
    def generation(layout: str, how: str) -> Generation:
        rows = prompts[layout]
        if how == "batch":
            return torch_generate(module, spec, rows, steps, pad, bits, activations)
        return stacked([torch_generate(module, spec, [row], steps, pad, bits, activations) for row in rows])

    return _Reference(prompts, pad, eos_tokens(config), generation)


def recorded_reference(out_dir: Path, entry: ManifestEntry, spec: ModelSpec, options: VerifyOptions) -> _Reference:
    """Golden mode: the generations build recorded (no torch) for ``entry``'s rounding, and
    the build's genai folder; ArtifactError or UsageError where they cannot serve."""
    bits = generation_rounding(spec, entry.variant)
    if not entry.generations:
        raise ArtifactError(
            f"{entry.name}: the build recorded no generations (built by an older attn-export, or its module "
            "generates without a transformers config); rebuild it, or verify --generate without --golden"
        )
    changed = integrity(out_dir, entry, "generations", graph=False)  # the graph's own check is a FAIL row
    if changed:
        raise ArtifactError(changed[-1])
    budget = memory_budget(options.max_memory)
    recorded = read_generations(out_dir / entry.generations, spec, logits_vocab(spec), budget, out_dir)
    steps = options.generate_steps
    if steps > recorded.steps:
        fewer = f"{{golden}} {{generate_steps}} {steps}: {entry.name}'s build recorded {recorded.steps} new tokens; "
        fewer += f"ask for {recorded.steps} or fewer, or verify {{generate_steps}} without {{golden}}"
        raise OptionError(fewer, ["golden", "generate_steps"])
    rounding = "none" if bits is None else rounding_name(bits)
    if not any(key[0] == rounding for key in recorded.runs):
        raise ArtifactError(f"{entry.name}: the build recorded no generation with the {rounding} rounding")

    def generation(layout: str, how: str) -> Generation:
        run = recorded.run(rounding, layout, how, steps)
        return Generation(run.tokens, run.logits, run.room)

    return _Reference(recorded.prompts, recorded.pad, recorded.eos, generation)


def generate_model(
    out_dir: Path, entry: ManifestEntry, spec: ModelSpec, options: VerifyOptions
) -> list[GenerateResult]:
    """Every generation of ``entry``'s graph this run asks for, judged against PyTorch's
    (run here, or recorded at build in golden mode)."""
    bits = generation_rounding(spec, entry.variant)
    graph = out_dir / entry.file

    def tolerance_on(target: Target) -> Tolerance:
        """int4's rounding on a CPU is simulated to float32 noise: there its logits are held
        to the tolerance against the simulation (``target_tolerances``)."""
        logits = target_tolerances(spec, entry.variant, options, target, graph)["logits"]
        return logits.simulated or logits

    if options.golden:
        reference = recorded_reference(out_dir, entry, spec, options)
    else:
        reference = _from_torch(spec, options, bits, int4_activations(graph))
    steps, pad, eos = options.generate_steps, reference.pad, reference.eos
    side = padding_side(spec, entry.variant, lambda: load_model_file(graph))
    results = []

    def judged_row(
        runner: str, layout: str, rows: list[list[int]], want: Generation, got: Generation | str, tolerance: Tolerance
    ) -> None:
        """The row of one runner's generation; one that could not run diverges at its first step."""
        if isinstance(got, str):
            judged, tokens = Judged([], got, 1, []), []
        else:
            judged, tokens = judge(want, got, tolerance, eos), got.tokens
        results.append(GenerateResult(entry.name, runner, layout, rows, steps, want.tokens, tokens, *judged))

    for target in options.targets:
        if target.runtime != "onnxruntime":
            continue
        budget = memory_budget(options.max_memory, spec)
        with RUNTIMES[target.runtime].make(
            graph, spec, target, options.threads, budget, options.region_timeout_s
        ) as runtime:
            for layout, rows in reference.prompts.items():
                padded = uneven(rows)
                if padded and side is None:
                    continue  # a graph that takes no padding runs prompts of one length
                got = _run(graph_generate, runtime, spec, rows, steps, pad, side or "left")
                # padded on the right, each row gives what its prompt alone gives, as in genai's generator
                want = reference.generation(layout, "alone" if padded and side == "right" else "batch")
                judged_row(target.label, layout, rows, want, got, tolerance_on(target))
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return results
    from attn_export.runtimes.genai import genai_generate

    folder_there = out_dir / GENAI_DIR / entry.name
    # an older build recorded no hashes of its folder: golden mode (no torch to make one) runs it as it is
    shipped = folder_there if entry.genai or (options.golden and folder_there.is_dir()) else None
    changed = "; ".join(genai_integrity(out_dir, entry))
    with tempfile.TemporaryDirectory(prefix="attn-export-genai-") as tmp:
        folder = shipped or _genai_folder(graph, spec, entry.variant, Path(tmp))
        for layout, rows in reference.prompts.items() if folder is not None else ():
            # genai pads on the right and masks: each row gives what its prompt alone gives
            want = reference.generation(layout, "alone")
            got = changed or _run(genai_generate, folder, rows, steps, pad, options.threads)
            judged_row(GENAI, layout, rows, want, got, tolerance_on(GENAI_CPU))  # genai runs on the CPU
            diverged = uneven(rows) and not isinstance(got, str) and not results[-1].passed
            if diverged and (window := _short_window(spec)) is not None:  # a config made only where it may tell
                results[-1].divergence += f" ({right_padded_window(window)})"
    return results


def _short_window(spec: ModelSpec) -> int | None:
    """The config's sliding window where it is shorter than the cache reaches
    (``short_window``): read off the config transformers makes, its class's defaults
    included (Qwen2's window is off unless asked), else, without transformers (golden mode
    on a deploy box), off the spec's table."""
    from attn_export.exporter.factory import build_config

    try:
        config = build_config(spec) if importlib.util.find_spec("transformers") else None
    except AttnExportError:
        config = None
    return short_window(spec, config)


def _genai_folder(graph: Path, spec: ModelSpec, variant: str, tmp: Path) -> Path | None:
    """The folder ``build --target genai`` would write for the graph, in ``tmp``; None where
    genai could not run it."""
    from attn_export.exporter.factory import build_config

    config = build_config(spec)
    try:
        genai_config(spec, config, variant)
    except SpecError:
        return None
    return write_genai_folder(graph, spec, config, tmp / "model", variant, fed_by_genai(variant))
