"""Value distributions for float inputs: where real activations differ from unit noise.

Real transformer activations carry outliers (a few hidden channels tens of times larger
than the rest); that is where fp16 overflows, int8 per-tensor scales collapse, and
saturating or clipping ops hide. Verify runs every model on each of these.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["DEFAULT", "DISTRIBUTIONS", "case_label", "sample", "split_label"]


def _normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape)


def _large(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return 100.0 * rng.standard_normal(shape)


def _tiny(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return 1e-3 * rng.standard_normal(shape)


def _outliers(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Unit noise with a few channels (of the last axis) fifty times larger."""
    x = rng.standard_normal(shape)
    if shape and shape[-1] > 1:
        channels = rng.choice(shape[-1], size=max(1, min(3, shape[-1] // 8)), replace=False)
        x[..., channels] *= 50.0
    return x


#: name -> (sampler, what it models); the first is the default.
DISTRIBUTIONS: dict[str, tuple[Callable[[np.random.Generator, tuple[int, ...]], np.ndarray], str]] = {
    "normal": (_normal, "unit normal"),
    "large": (_large, "unit normal x100"),
    "outliers": (_outliers, "a few channels x50 on a unit background"),
    "tiny": (_tiny, "unit normal x0.001"),
}
DEFAULT = "normal"


def sample(distribution: str, rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Values of ``distribution`` for one float input."""
    return DISTRIBUTIONS[distribution][0](rng, shape).astype(dtype)


def case_label(shape: str, distribution: str) -> str:
    """A golden case's label: the shape's, with ``@distribution`` unless it is the default."""
    return shape if distribution == DEFAULT else f"{shape}@{distribution}"


def split_label(label: str) -> tuple[str, str]:
    """(shape label, distribution) of a golden case label; unknown distributions stay in
    the label so that a doctored file cannot pick one."""
    shape, _, distribution = label.partition("@")
    return (shape, distribution) if distribution in DISTRIBUTIONS else (label, DEFAULT)
