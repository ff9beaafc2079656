"""What a spec file leaves to its module, learned the one way wherever a module is run: the
values its ids take to land on their tables' rows (``lookup_ranges``), and that the module
reads every mask as declared (``mask_probe``: a SpecError where it reads one another way;
judged by a convention the wrong way round, the named mask cases test other rows). Build,
verify (a checkout's spec, a graph no build made) and the Python API all learn here, so no
two of them judge a spec learned two ways."""

from __future__ import annotations

from typing import Any

from attn_export.checks.mask_probe import check_masks
from attn_export.errors import AttnExportError
from attn_export.exporter.index_inputs import undeclared_ids, with_lookup_ranges
from attn_export.model_spec import ModelSpec
from attn_export.model_spec.shapes import example_sizes
from attn_export.runtimes import Runtime

__all__ = ["LEARN_SEED", "checkout_ranges", "learn_ranges", "learned_spec", "needs_module", "read_masks"]

#: The seed of the inputs a spec is learned from (build's, so verify learns what build did).
LEARN_SEED = 0


def needs_module(spec: ModelSpec) -> bool:
    """Whether ``spec`` leaves anything to learn: a mask to read or ids with no declared values."""
    return bool(spec.masks or undeclared_ids(spec))


def learn_ranges(module: Any, spec: ModelSpec) -> ModelSpec:
    """``spec`` with the values its undeclared ids take read from ``module``."""
    return with_lookup_ranges(module, spec)


def read_masks(spec: ModelSpec, eager: Runtime) -> None:
    """SpecError where ``eager`` (the module) reads a mask another way than ``spec`` declares,
    probed at the example sizes."""
    check_masks(spec, eager, example_sizes(spec), LEARN_SEED)


def learned_spec(module: Any, spec: ModelSpec) -> ModelSpec:
    """``spec`` as build learns it from ``module`` before an export: its ids' ranges, and every
    mask read as declared."""
    from attn_export.runtimes.torch_eager import TorchRuntime

    spec = learn_ranges(module, spec)
    if spec.masks:
        with TorchRuntime(module, spec.inputs, spec.outputs, spec.dims) as eager:
            read_masks(spec, eager)
    return spec


def checkout_ranges(spec: ModelSpec) -> ModelSpec:
    """``spec`` with its undeclared ids' ranges read from a module made from it, as build read
    them; as it is where the module cannot be made (the run that needs the module says why)."""
    if not undeclared_ids(spec):
        return spec
    from attn_export.exporter.factory import instantiate

    try:
        module = instantiate(spec)
    except AttnExportError:
        return spec
    return learn_ranges(module, spec)
