"""localize: where a graph leaves PyTorch, node and source line, for one case."""

from attn_export.pipelines.localize.results import LocalizeReport, RegionError
from attn_export.pipelines.localize.run import LocalizeOptions, localize_failures, localize_model

__all__ = ["LocalizeOptions", "LocalizeReport", "RegionError", "localize_failures", "localize_model"]
