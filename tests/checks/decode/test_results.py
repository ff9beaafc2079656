"""A decode result says which module bug a padded row shows: a cache that differs while every
output agrees, or padding that changes what a real token sees."""

from __future__ import annotations

import numpy as np

from attn_export.checks.decode.results import DecodeResult
from attn_export.compare import compare_output
from attn_export.model_spec import Tolerance
from attn_export.runtimes import Target


def test_a_padded_row_that_differs_only_in_its_cache_is_said_so() -> None:
    tol, same = Tolerance(1e-5, 1e-4), np.ones((1, 3), np.float32)
    agree = compare_output("output (row 1)", same, same.copy(), tol)
    differs = compare_output("present.0.key (row 1)", same, same + 1, tol)
    result = DecodeResult(
        "m", Target("onnxruntime", "cpu"), "left-padded", "torch[cpu]", [5, 0, 2], unpadded=[agree, differs]
    )
    assert result.reasons()[0].startswith(
        "module bug: the cache differs, not the outputs: a left-padded row's tokens, alone and unpadded, give every "
        "output the batch gave them but another present.0.key (row 1): present.0.key (row 1): 3/3 elements"
    )
    result.unpadded = [compare_output("output (row 1)", same, same + 1, tol), differs]
    assert result.reasons()[0].startswith("module bug: padding changes what a real token sees")
