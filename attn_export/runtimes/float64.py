"""Run a module in float64 where its code names a narrower float: ``torch.eye(n,
dtype=torch.float32)``, ``x.float()``, a table built in float32. Cast to double as a whole,
such a module fails at the first op that meets a float32 tensor, and PyTorch's own rounding
error (the precision floor a comparison allows for) cannot be measured; under this mode
every float tensor an op is given, and every float dtype it is asked for, is float64."""

from __future__ import annotations

from typing import Any

from attn_export._deps import require

__all__ = ["in_float64"]


def in_float64(call: Any, *args: Any) -> Any:
    """``call(*args)`` with every float32, float16 and bfloat16 widened to float64."""
    torch = require("torch", "running the PyTorch original")
    from torch.overrides import TorchFunctionMode

    narrow = (torch.float32, torch.float16, torch.bfloat16)
    casts = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)
    tensor, dtype = torch.Tensor, torch.dtype

    def wide(x: Any) -> Any:
        """``x`` with its narrow floats widened; ``x`` itself where none is (most calls:
        a mode sees every attribute read, and rebuilding their arguments cost 4x the module)."""
        if isinstance(x, tensor):
            return x.double() if x.dtype in narrow else x
        if isinstance(x, dtype):
            return torch.float64 if x in narrow else x
        if isinstance(x, (tuple, list)):
            items = [wide(v) for v in x]
            if all(a is b for a, b in zip(items, x, strict=True)):
                return x
            return type(x)(items) if not hasattr(x, "_fields") else type(x)(*items)
        if isinstance(x, dict):
            changed = {k: wide(v) for k, v in x.items()}
            return x if all(changed[k] is v for k, v in x.items()) else changed
        return x

    class Widened(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in casts:  # x.float(): to float64 instead
                return args[0].double() if args[0].is_floating_point() else args[0].to(torch.float64)
            return func(*wide(tuple(args)), **wide(dict(kwargs or {})))

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # torch.tensor([1 / 3]), torch.zeros(n)
    try:
        with Widened():
            return call(*args)
    finally:
        torch.set_default_dtype(default)
