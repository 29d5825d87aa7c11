"""Keeps freed memory in the process instead of handing it back to the kernel after every step.

A worker allocates and frees the same large tensors every step (a DLRM step's activations, the
exchange's buffers). glibc's malloc serves a multi-threaded process from several arenas and
hands free memory at an arena's top back to the kernel, so the next step takes those pages again
as fresh page faults, zeroed by the kernel. A NestPipe worker has more threads than a one-process
job (the socket mesh, the gRPC server), hence more arenas. The top pad (`M_TOP_PAD`: an arena
keeps up to that much free memory at its top instead of returning it) helps where
`MALLOC_TRIM_THRESHOLD_` or `MALLOC_MMAP_THRESHOLD_` alone do not, since glibc also unmaps a
thread arena's whole heap once it is free unless the pad keeps it; it costs little peak
resident memory. `bench/compare_worker.py` measures the page faults per step.

`keep_freed_memory` sets it in-process (the strategy calls it at construction); the local
launcher also puts `MALLOC_TOP_PAD_` in each task's environment (`allocator_env`), which glibc
reads at its first allocation (it then covers the arenas created before the strategy). A value
the user set in the environment is never overridden. Not glibc (e.g. musl, macOS): nothing is
changed.
"""
import ctypes
import ctypes.util
import os
from typing import Dict, Mapping

# glibc's environment variable and mallopt parameter for the top pad (malloc.h: M_TOP_PAD -2).
TOP_PAD_ENV = "MALLOC_TOP_PAD_"
_M_TOP_PAD = -2

# What an arena keeps free at its top: larger than a step's largest tensors on the testbed.
DEFAULT_TOP_PAD_BYTES = 64 << 20

SET, USER_SET, UNAVAILABLE, DISABLED = "set", "user_set", "unavailable", "disabled"


def check_top_pad(top_pad_bytes):
    """`top_pad_bytes` as an int >= 0 (0: leave the allocator alone); refuses anything else."""
    if isinstance(top_pad_bytes, bool) or not isinstance(top_pad_bytes, int) or top_pad_bytes < 0:
        raise ValueError("malloc_top_pad_bytes must be an int >= 0 (bytes an allocator arena "
                         "keeps free; 0 leaves the allocator as it is), got %r" % (top_pad_bytes,))
    if top_pad_bytes >= 1 << 31:
        raise ValueError("malloc_top_pad_bytes must be below 2 GiB (glibc's mallopt takes an "
                         "int), got %d" % top_pad_bytes)
    return top_pad_bytes


def _glibc():
    """The C library if it is glibc (has mallopt and gnu_get_libc_version), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


def keep_freed_memory(top_pad_bytes=DEFAULT_TOP_PAD_BYTES, env=None, libc=None):
    """Makes this process's malloc arenas keep up to `top_pad_bytes` of freed memory
    (`mallopt(M_TOP_PAD)`) instead of returning it to the kernel after each step. Returns what
    happened: SET, USER_SET (`MALLOC_TOP_PAD_` is in `env`, default `os.environ`: the user's
    value stays), UNAVAILABLE (not glibc, or mallopt refused) or DISABLED (`top_pad_bytes` 0).
    `libc` (tests): the library to call, default this process's glibc."""
    top_pad_bytes = check_top_pad(top_pad_bytes)
    if top_pad_bytes == 0:
        return DISABLED
    if TOP_PAD_ENV in (os.environ if env is None else env):
        return USER_SET
    libc = _glibc() if libc is None else libc
    if libc is None:
        return UNAVAILABLE
    return SET if libc.mallopt(_M_TOP_PAD, top_pad_bytes) == 1 else UNAVAILABLE


def allocator_env(env: Mapping[str, str],
                  top_pad_bytes: int = DEFAULT_TOP_PAD_BYTES) -> Dict[str, str]:
    """The variable to add to a task's environment `env` so its allocator keeps freed memory
    from its first allocation: `MALLOC_TOP_PAD_`, unless `env` sets it already (the user's
    choice wins) or `top_pad_bytes` is 0."""
    top_pad_bytes = check_top_pad(top_pad_bytes)
    if top_pad_bytes == 0 or TOP_PAD_ENV in env:
        return {}
    return {TOP_PAD_ENV: str(top_pad_bytes)}
