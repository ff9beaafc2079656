"""Timing and benchmarks: warm-up, repeats, percentiles and synchronisation live here only."""
