"""The build pipeline: spec -> module -> ONNX -> variants -> checks -> artifacts."""

from attn_export.pipelines.building.results import BuildOptions, BuildResult, BuildStatus, BuildSummary
from attn_export.pipelines.building.run import build_models, export_module

__all__ = ["BuildOptions", "BuildResult", "BuildStatus", "BuildSummary", "build_models", "export_module"]
