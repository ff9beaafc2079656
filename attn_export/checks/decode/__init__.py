"""Stage: multi-step decoding of a model with a key/value cache (``model_spec.cache``).

A trajectory is a prompt step (an empty cache, the whole prompt) and then N steps of one
token. Each side, the expected one (PyTorch, or the golden recording) and the graph, feeds
its own ``present`` back as its ``past``, so an error that only shows once a cache holds
something grows step by step as it does in deployment. Two padding layouts (the code's
``scenario``, not to be confused with ``model_spec.scenarios``' presets): batch 1, and a
left-padded batch with different prompt lengths (one row all padding during the prompt).
PyTorch is also checked against itself without a cache (every token so far in one step): a
cache that disagrees with recompute is a bug in the module, reported as such. At every step
each present must hold what its past and the new tokens make, on both sides
(``checks.cache_growth``). A sliding-window cache (``[cache] window = N``) is fed back as it
is kept: a step's past is the newest ``min(tokens so far, N)`` positions and its mask covers
those and the new tokens; the recompute and the padded rows alone compare the positions both
sides still hold.

Steps are numbered from 1, the prompt; a causal mask aligned to the wrong end first shows
at step 2, when the cache is no longer empty.
"""

from attn_export.checks.decode.judge import compare_trajectories, unpadded
from attn_export.checks.decode.plan import (
    DEFAULT_STEPS,
    LAYOUTS,
    Trajectory,
    layouts,
    one_pass_feeds,
    pass_length,
    plan_trajectory,
    step_count,
)
from attn_export.checks.decode.results import DecodeResult, DecodeStep
from attn_export.checks.decode.run import pytorch_trajectories, recompute, run_trajectory

__all__ = [
    "DEFAULT_STEPS",
    "LAYOUTS",
    "DecodeResult",
    "DecodeStep",
    "Trajectory",
    "compare_trajectories",
    "layouts",
    "one_pass_feeds",
    "pass_length",
    "plan_trajectory",
    "pytorch_trajectories",
    "recompute",
    "run_trajectory",
    "step_count",
    "unpadded",
]
