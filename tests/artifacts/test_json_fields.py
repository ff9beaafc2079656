"""``json_record``: a dataclass read from JSON field by field, one line naming the first field
missing, unknown or not of its type."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from attn_export.artifacts.json_fields import json_record
from attn_export.errors import ArtifactError


@dataclass
class _Timing:
    p50_ms: float
    repeats: int
    load: float | None = None
    shape: list[int] = field(default_factory=list)


def test_a_record_reads_its_fields_and_defaults() -> None:
    assert json_record(_Timing, {"p50_ms": 1, "repeats": 5}, "t") == _Timing(1, 5)
    full = {"p50_ms": 1.5, "repeats": 5, "load": None, "shape": [2, 3], "passed": True}
    assert json_record(_Timing, full, "t", derived=("passed",)) == _Timing(1.5, 5, None, [2, 3])


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1.0, 5], "t: a list, not an object"),
        ({"repeats": 5}, "t.p50_ms: missing"),
        ({"p50_ms": "1.0", "repeats": 5}, "t.p50_ms: a string, not float"),
        ({"p50_ms": 1.0, "repeats": True}, "t.repeats: a boolean, not int"),
        ({"p50_ms": 1.0, "repeats": 5, "shape": "23"}, "t.shape: a string, not list[int]"),
        ({"p50_ms": 1.0, "repeats": 5, "p90_ms": 2.0}, "t.p90_ms: unknown field"),
        ({"p50_ms": 1.0, "repeats": 5, "passed": True}, "t.passed: unknown field"),
    ],
)
def test_a_malformed_record_is_one_line_naming_its_field(doc: object, message: str) -> None:
    with pytest.raises(ArtifactError) as e:
        json_record(_Timing, doc, "t")
    assert str(e.value) == message
