"""The ``auto`` variant's choice: the fastest candidate within the model's tolerance, kept
only when it beats the plain graph beyond the noise."""

from __future__ import annotations

from typing import Any

from attn_export.compare import compare_outputs
from attn_export.compare.latency import clearly_faster, noise
from attn_export.errors import AttnExportError, GraphCheckError
from attn_export.model_spec.inputs import make_feeds
from attn_export.model_spec.variants import auto_candidates
from attn_export.pipelines.building.graphs import BUILD_SEED, SpecBuild
from attn_export.runtimes.ort import OnnxRuntime
from attn_export.runtimes.timing import LatencyStats, measure, physical_cores
from attn_export.runtimes.torch_eager import TorchRuntime

__all__ = ["auto_choice"]


def auto_choice(ctx: SpecBuild) -> tuple[str, dict[str, Any]]:
    """Time each candidate at the spec's typical shape; the fastest within the model's own
    tolerance wins, but only if it beats the plain graph by more than the noise (and the
    timings are not noisy): otherwise the plain graph stays. Candidates that fail to
    build or to agree are recorded, not chosen."""
    spec, provider = ctx.spec, ctx.options.provider
    feeds = make_feeds(spec, spec.typical, BUILD_SEED)
    with TorchRuntime(ctx.module.get(), spec.inputs, spec.outputs, spec.dims) as eager:
        expected = eager.run(feeds)
    tolerances = spec.tolerances("auto")
    figures: dict[str, dict[str, Any]] = {}
    timings: dict[str, LatencyStats] = {}
    for name in auto_candidates(provider):
        try:
            model = ctx.graph(name).model
            with OnnxRuntime(
                model, spec.inputs, spec.outputs, spec.dims, provider=provider, threads=physical_cores()
            ) as session:
                comparisons = compare_outputs(expected, session.run(feeds), tolerances)
                stats = measure(session.prepare(feeds), budget_s=0.3, warmup=3)
        except AttnExportError as e:
            figures[name] = {"error": str(e)}
            continue
        timings[name] = stats
        figures[name] = {
            "p50_ms": stats.p50_ms,
            "p90_ms": stats.p90_ms,
            "max_abs_error": max(c.max_abs_error for c in comparisons),
            "within_tolerance": all(c.passed for c in comparisons),
            "noise": noise(stats),
        }
    passing = [n for n, f in figures.items() if f.get("within_tolerance")]
    if not passing:
        raise GraphCheckError(f"{spec.name}: auto found no variant within the model's tolerance: {figures}")
    fastest = min(passing, key=lambda n: figures[n]["p50_ms"])
    base = "fp32" if "fp32" in passing else fastest
    noisy = noise(*(timings[n] for n in passing))
    if noisy:
        chosen, why = base, f"timings {noisy}: kept {base}"
    elif fastest != base and not clearly_faster(timings[fastest], timings[base]):
        chosen, why = base, f"{fastest} is not faster than {base} beyond the noise (its p90 >= {base}'s p50)"
    else:
        chosen, why = fastest, "fastest within the model's tolerance"
    info = {"chosen": chosen, "why": why, "provider": provider, "shape": dict(spec.typical), "figures": figures}
    return chosen, info
