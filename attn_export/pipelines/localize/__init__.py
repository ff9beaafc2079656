"""localize: where a graph leaves PyTorch, node and source line, for one case."""

from attn_export.pipelines.localize.replay import ReplayResult, replay_bundle
from attn_export.pipelines.localize.results import LocalizeOptions, LocalizeReport, RegionError
from attn_export.pipelines.localize.run import check_regions, localize_failures, localize_model

__all__ = [
    "LocalizeOptions",
    "LocalizeReport",
    "RegionError",
    "ReplayResult",
    "check_regions",
    "localize_failures",
    "localize_model",
    "replay_bundle",
]
