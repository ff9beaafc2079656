"""How far right int8 and fp16 graphs are from PyTorch, as shares of each output's rms: the
figures the lossy variants' default tolerances (``model_spec.variants.INT8_TOLERANCE``,
``FP16_TOLERANCE``) are set from.

    python benchmarks/lossy_errors.py            # builds tests/models' int8 and fp16 graphs first

For every case and decode step of verify's plan, per variant and value distribution: the
worst element's error over the output's rms (at atol 0, rtol 0: the share ``atol_rms`` must
hold) and the error's rms over the output's rms (what ``rms_rtol`` must hold); the largest,
the 90th percentile and the median.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

from attn_export.artifacts.manifest import load_manifest
from attn_export.compare import OutputComparison
from attn_export.model_spec import spec_paths
from attn_export.pipelines.building import BuildOptions, build_models
from attn_export.pipelines.verify import VerifyOptions, verify_artifacts

MODELS = Path(__file__).resolve().parents[1] / "tests" / "models"


def _shares(c: OutputComparison) -> tuple[float, float] | None:
    """(worst element, error rms) over the output's rms, where it has one."""
    if not c.numeric or c.rms == 0:
        return None
    return (c.min_passing_atol - 10 * c.floor) / c.rms, c.rms_error / c.rms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=MODELS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        summary = build_models(spec_paths(args.models), BuildOptions(out, variants=("int8", "fp16")))
        for r in summary.results:
            if not r.ok:
                print(f"not built: {r.name}: {r.error}")
        manifest = load_manifest(out)
        options = VerifyOptions(models_dir=args.models, latency=False, atol=0.0, rtol=0.0, decode_steps=8)
        report = verify_artifacts(out, manifest, list(manifest.models), options)
    found: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for case in report.cases:
        for c in case.comparisons:
            if (s := _shares(c)) is not None:
                found[(case.model.partition(".")[2], case.distribution)].append(s)
    for trajectory in report.decode:
        for step in trajectory.steps:
            for c in step.comparisons:
                if (s := _shares(c)) is not None:
                    found[(trajectory.model.partition(".")[2], "decode")].append(s)
    head = "worst element / rms (max p90 median)  error rms / rms (max p90 median)"
    print(f"{'variant':8} {'values':9} {'n':>4}  {head}")
    for (variant, values), shares in sorted(found.items()):
        cells = []
        for i in (0, 1):
            column = sorted((s[i] for s in shares), reverse=True)
            cells.append(" ".join(f"{column[k]:.3g}" for k in (0, len(column) // 10, len(column) // 2)))
        print(f"{variant:8} {values:9} {len(shares):>4}  {cells[0]:38} {cells[1]}")


if __name__ == "__main__":
    main()
