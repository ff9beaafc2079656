"""The verify pipeline: manifest -> checks -> expected outputs -> runtimes -> comparison."""

from attn_export.pipelines.verify.expected import case_plan
from attn_export.pipelines.verify.models import checkout_spec, decoder_names, select_models, shard_names
from attn_export.pipelines.verify.results import (
    REGIONS,
    CaseResult,
    ModelCheck,
    PlacementResult,
    Shard,
    VerifyOptions,
    VerifyReport,
)
from attn_export.pipelines.verify.run import verify_artifacts, verify_module

__all__ = [
    "CaseResult",
    "ModelCheck",
    "PlacementResult",
    "REGIONS",
    "Shard",
    "VerifyOptions",
    "VerifyReport",
    "case_plan",
    "checkout_spec",
    "decoder_names",
    "select_models",
    "shard_names",
    "verify_artifacts",
    "verify_module",
]
