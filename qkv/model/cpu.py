"""The CPU as qkv runs on it: the C allocator's settings, and whether the CPU multiplies bfloat16.

A training step frees and allocates the same large tensors every step (a batch's activations, the
vocabulary-sized gradient of the output layer). glibc's malloc serves blocks over its mmap threshold
(at most 32 MiB, after its dynamic adjustment) with ``mmap`` and gives them back to the kernel on
``free``; the next step touches fresh pages and takes a page fault on each 4 KiB of them. Measured
on the multi30k preset (docs/benchmarks.md, (b)): tens of thousands of faults per step and a fifth of
the CPU time in the kernel. Telling glibc to keep what it has (no mmap, no trimming of the heap's
top) removes them; the memory the process holds is then its peak, as a caching allocator's is.

Nothing here runs at import or when a model or translator is made: ``Trainer`` calls
``tune_allocator`` when training starts (``TrainConfig.tune_allocator``), and the command line and
the server call it once where they start (decoding frees and allocates too).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

# mallopt parameters from glibc's <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
TRIM_THRESHOLD = 1 << 30  # free memory kept at the heap's top before it is given back (1 GiB)
# glibc's own settings once its dynamic threshold has grown to the maximum (the state of a process
# that has freed a block of 32 MiB): what every training step met before tune_allocator existed.
GLIBC_STEADY_STATE = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20, M_MMAP_MAX: 65536}


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (the only one whose ``mallopt`` we know), else None."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version  # absent from musl, macOS and Windows
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc if version() else None


def _mallopt(settings: dict[int, int]) -> bool:
    libc = _glibc()
    if libc is None:
        return False
    return all(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1 for param, value in settings.items())


def tune_allocator() -> bool:
    """Stop glibc from returning large freed blocks to the kernel (no mmap for large blocks, trim
    only past 1 GiB free at the heap's top), as ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824``
    would at start-up. Process-wide and idempotent; returns whether it applied (False when the C
    library is not glibc, e.g. musl or macOS, where nothing changes)."""
    return _mallopt({M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD})


def untune_allocator() -> bool:
    """Put glibc back into its steady state before ``tune_allocator`` (for benchmarks that compare
    both in one process) and give the free heap back to the kernel."""
    applied = _mallopt(GLIBC_STEADY_STATE)
    if applied:
        _glibc().malloc_trim(ctypes.c_size_t(0))
    return applied


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX-512 BF16 or AMX, read from
    /proc/cpuinfo's flags on Linux). Elsewhere PyTorch still computes in bfloat16, by emulation and
    slower than float32, so qkv uses it only where this says True."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))
