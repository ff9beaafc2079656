"""One JSON writer, strict: a result holding NaN or Infinity is still JSON, and reads back."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from attn_export.artifacts.json_text import json_floats, json_text
from attn_export.compare.outputs import OutputComparison, compare_output
from attn_export.model_spec.tolerance import Tolerance
from tests.conftest import ROOT


def _strict(text: str) -> object:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_a_result_holding_nan_and_infinity_is_valid_json_and_reads_back() -> None:
    nan_case = compare_output("o", np.zeros(2, np.float32), np.array([0, np.nan], np.float32), Tolerance(0, 0))
    doc = {"nan": math.nan, "nested": [(math.inf, -math.inf)], "result": nan_case.to_dict()}
    text = json_text(doc)
    assert text.endswith("}\n") and "NaN" not in text and "Infinity" not in text
    back = json_floats(_strict(text))
    assert math.isnan(back["nan"]) and back["nested"] == [[math.inf, -math.inf]]
    assert OutputComparison.from_dict(back["result"]) == nan_case


def test_finite_documents_are_written_as_json_dumps_writes_them() -> None:
    """The graphs' metadata and the manifest's hash depend on these bytes."""
    doc = {"b": [1, 2.5, "é"], "a": None}
    assert json_text(doc, sort_keys=True) == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    assert json_text(doc, indent=None, end="", ensure_ascii=False) == json.dumps(doc, ensure_ascii=False)


#: json.dumps where no document is written or printed: fingerprints hashed on the spot, and
#: the request a bench child process reads back.
NOT_WRITTEN = {
    "model_spec/model.py",
    "pipelines/building/cells.py",
    "executors/__init__.py",
    "pipelines/bench/memory.py",
}


def test_every_json_the_tool_writes_goes_through_json_text() -> None:
    package = ROOT / "attn_export"
    calls = {
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if re.search(r"\bjson\.dumps?\(", p.read_text()) and p.name != "json_text.py"
    }
    assert calls == NOT_WRITTEN, calls ^ NOT_WRITTEN
