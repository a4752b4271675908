"""glibc's allocator statistics (mallinfo2), for measuring CPU memory that torch's profiler does not
see (Inductor's compiled code allocates its buffers itself) and for splitting a process's resident
memory into bytes in use and freed bytes the heap keeps (bench/cpu_heap.py). Linux with glibc 2.33
or newer."""

from __future__ import annotations

import ctypes

__all__ = ["malloc_state", "malloc_in_use"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = None


def _mallinfo2() -> _MallInfo2:
    global _libc
    if _libc is None:  # loaded on first use: importing this module must work where glibc is absent
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallinfo2.restype = _MallInfo2
    return _libc.mallinfo2()


def malloc_state() -> dict[str, int]:
    """Summed over glibc's arenas: heap size, bytes in use (heap + mmapped blocks), bytes free
    inside the heap, bytes in mmapped blocks."""
    m = _mallinfo2()
    return {"heap": m.arena, "in_use": m.uordblks + m.hblkhd, "free_in_heap": m.fordblks, "mmapped": m.hblkhd}


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back (heap and mmapped blocks)."""
    m = _mallinfo2()
    return m.uordblks + m.hblkhd
