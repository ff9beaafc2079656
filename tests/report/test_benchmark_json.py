"""bench --benchmark-json: the shape github-action-benchmark's customSmallerIsBetter tool reads
(its ``BenchmarkResult`` schema: ``name``, ``unit``, ``value``, optional ``range`` and
``extra``). The real runs that write it are the bench fixtures of tests/pipelines."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest

#: What the action's schema allows (it requires the first three; ours always carry all five).
KEYS = {"name": str, "unit": str, "value": float, "range": str, "extra": str}
#: The action's range parser (extractRangeInfo): a "±" or "+-" and a number.
RANGE = re.compile(r"(\+-|±)\s*(?P<value>\d.*)")


def custom_smaller_is_better(text: str) -> list[dict[str, Any]]:
    """Parse ``text`` as the action would and return its entries; AssertionError on any
    entry it would refuse or misread. Ours always carry all five keys, names unique."""
    entries = json.loads(text)
    assert isinstance(entries, list) and entries, "a non-empty JSON list"
    for e in entries:
        assert isinstance(e, dict) and set(e) == set(KEYS), e
        for key, kind in KEYS.items():
            value = e[key]
            if kind is float:
                assert isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value), e
            else:
                assert isinstance(value, kind) and value, e
        assert e["unit"] == "ms" and e["value"] > 0
        match = RANGE.fullmatch(e["range"])
        assert match and float(match["value"]) >= 0, e["range"]
    names = [e["name"] for e in entries]
    assert len(set(names)) == len(names), "names are unique"
    return entries


@pytest.mark.parametrize(
    "bad",
    [
        {"name": "a", "unit": "ms", "value": "1.0", "range": "± 0.1", "extra": "x"},  # value a string
        {"name": "a", "unit": "ms", "value": 1.0, "range": "0.1", "extra": "x"},  # range without ±
        {"name": "a", "unit": "ms", "value": 1.0, "range": "± 0.1"},  # a key missing
        {"name": "a", "unit": "ms", "value": True, "range": "± 0.1", "extra": "x"},  # a bool is no number
    ],
)
def test_the_shape_check_refuses_what_the_action_would_misread(bad: dict[str, Any]) -> None:
    with pytest.raises(AssertionError):
        custom_smaller_is_better(json.dumps([bad]))


def test_the_shape_check_refuses_duplicate_names() -> None:
    entry = {"name": "a", "unit": "ms", "value": 1.0, "range": "± 0.1", "extra": "x"}
    custom_smaller_is_better(json.dumps([entry]))
    with pytest.raises(AssertionError, match="unique"):
        custom_smaller_is_better(json.dumps([entry, entry]))
