"""Stage 1, the model spec: TOML model specs, the variant table, shape sweeps and seeded feeds."""

from __future__ import annotations

from attn_export.model_spec.model import (
    DTYPES,
    EXPORTERS,
    MASK_KINDS,
    DimRange,
    Guard,
    ModelSpec,
    TensorSpec,
    WeightsSpec,
)
from attn_export.model_spec.parse import load_spec, spec_from_dict, spec_paths
from attn_export.model_spec.tolerance import Rounding, Tolerance
from attn_export.model_spec.variants import VARIANTS, Chain, VariantInfo, variant_chain, variant_key

__all__ = [
    "DTYPES",
    "EXPORTERS",
    "MASK_KINDS",
    "VARIANTS",
    "Chain",
    "DimRange",
    "Guard",
    "ModelSpec",
    "TensorSpec",
    "Rounding",
    "Tolerance",
    "VariantInfo",
    "WeightsSpec",
    "load_spec",
    "spec_from_dict",
    "spec_paths",
    "variant_chain",
    "variant_key",
]
