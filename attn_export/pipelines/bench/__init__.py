"""The bench pipeline: PyTorch and ONNX Runtime side by side per shape (``run``) and per
decode step (``decode``); timing itself lives in ``runtimes.timing``."""
