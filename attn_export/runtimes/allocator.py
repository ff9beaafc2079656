"""The C allocator a timed process runs with: freed memory kept, not handed back each call.

glibc's malloc serves a block over its mmap threshold (128 KiB to start) with a fresh
mapping and trims freed heap back to the OS. A decode step's ``torch.cat`` of its cache
then page-faults a new buffer in on every call: hundreds of faults per step, up to half
of its time in the kernel, and a figure that doubles when the host is busy. ONNX Runtime
keeps its tensors in its own arena; PyTorch gets the same footing here, as its CPU tuning
guide advises with a caching allocator (jemalloc or tcmalloc, which a user can preload
instead: where one is loaded, nothing is changed).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import re
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

#: glibc's largest mmap threshold: blocks up to it come from the heap and are reused.
MMAP_THRESHOLD = 32 * 2**20
#: Freed heap kept before glibc trims it back to the OS.
TRIM_THRESHOLD = 512 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def _caching_allocator() -> str | None:
    """The caching allocator (jemalloc, tcmalloc, mimalloc) mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            found = re.search(r"/(lib(?:jemalloc|tcmalloc|mimalloc)[^/\s]*)$", maps.read(), re.MULTILINE)
    except OSError:
        return None
    return found.group(1) if found else None


@functools.cache
def keep_freed_memory() -> str:
    """Set glibc's thresholds for this process, once; what the allocator now is, for reports."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return "the C library's, as it is"
    loaded = _caching_allocator()
    if loaded:
        return f"{loaded} (loaded in this process)"
    libc = ctypes.CDLL("libc.so.6")
    thresholds = (("mmap", _M_MMAP_THRESHOLD, MMAP_THRESHOLD), ("trim", _M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    refused = [name for name, param, value in thresholds if not libc.mallopt(param, value)]
    if refused:
        return f"glibc, its {' and '.join(refused)} threshold as it is (mallopt refused it)"
    return f"glibc keeping freed memory (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim {TRIM_THRESHOLD >> 20} MiB)"
