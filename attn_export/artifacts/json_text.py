"""The one JSON writer: every JSON document attn-export writes or prints goes through
``json_text``, so none holds NaN or Infinity, which are not JSON (``json.dumps`` writes them
by default, and strict readers such as ``jq`` or a browser refuse the whole file).

Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``;
``json_floats`` turns them back into floats.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["json_floats", "json_text"]

_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


def json_text(
    value: Any, *, indent: int | None = 2, sort_keys: bool = False, ensure_ascii: bool = True, end: str = "\n"
) -> str:
    """``value`` as strict JSON followed by ``end``: non-finite floats become strings, so the
    text always parses (``json.dumps`` would write the invalid tokens ``NaN``, ``Infinity``)."""
    text = json.dumps(_encode(value), indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii, allow_nan=False)
    return text + end


def json_floats(value: Any) -> Any:
    """A document ``json_text`` wrote, its ``"nan"``, ``"inf"`` and ``"-inf"`` strings floats again."""
    if isinstance(value, str) and value in _FLOATS:
        return _FLOATS[value]
    if isinstance(value, dict):
        return {k: json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_floats(v) for v in value]
    return value
