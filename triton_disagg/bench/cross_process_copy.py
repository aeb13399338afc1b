"""The kernel copy a NIXL READ of host memory rides on when both agents share a host:
UCX's cma transport moves it with ``process_vm_readv``. :func:`process_vm_readv_gbps`
times that syscall alone, between this process and a child holding the bytes, the way
:func:`triton_disagg.bench.handoff.memcpy_gbps` times a memcpy.

Invariants: the child's buffer holds :func:`pattern` and the first read is compared
with it before any timing, so a wrong address or a short read raises rather than
yielding a figure; a kernel that refuses the syscall (ptrace permission, a seccomp
filter) raises :class:`Refused`, whose message says why, never a figure.

``python -m triton_disagg.bench.cross_process_copy [NBYTES]`` prints the figure
(default 8,192,000 bytes: a 2,000-token prompt's KV on the demo engine).
"""

from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
import sys

REFUSING_ERRNOS = (errno.EPERM, errno.EACCES, errno.ENOSYS)
CHILD_TIMEOUT_S = 60.0


class Refused(Exception):
    """The kernel refused ``process_vm_readv`` here; the message says why."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc_process_vm_readv():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


def pattern(nbytes: int):
    """``nbytes`` uint8 of 0..250 repeating: the period (251, prime) is no multiple of a
    page, so a read from a shifted address does not match."""
    import numpy as np

    return np.resize(np.arange(251, dtype=np.uint8), nbytes)       # (251,) -> (nbytes,)


def _hold(nbytes: int, conn) -> None:
    """The child: fill a buffer of its own with :func:`pattern`, send its address,
    keep the buffer alive until the parent closes its end of the pipe."""
    held = pattern(nbytes)
    conn.send(held.ctypes.data)
    try:
        conn.recv()
    except EOFError:                                # the parent is done
        pass


def _check(got: int, nbytes: int, pid: int) -> None:
    """Raise unless one ``process_vm_readv`` call returned ``got == nbytes``."""
    if got == nbytes:
        return
    code = ctypes.get_errno() if got < 0 else 0
    if code in REFUSING_ERRNOS:
        raise Refused(f"process_vm_readv: {errno.errorcode[code]} ({os.strerror(code)}); "
                      "reading another process's memory needs ptrace permission "
                      "(kernel.yama.ptrace_scope, CAP_SYS_PTRACE) and no seccomp filter "
                      "refusing it")
    why = os.strerror(code) if code else "a short read"
    raise OSError(code, f"process_vm_readv of {nbytes} bytes from pid {pid} returned {got}: "
                        f"{why}")


def process_vm_readv_gbps(nbytes: int, repeats: int = 50) -> float:
    """GB/s of ``process_vm_readv`` copying ``nbytes`` from a child's buffer into one of
    this process's, best of ``repeats`` after warm-up (see
    :func:`triton_disagg.bench.copy_timing.best_gbps`). Raises :class:`Refused` when the
    kernel refuses the syscall, ``OSError`` on any other failure, ``RuntimeError`` when
    the bytes read are not the child's."""
    import numpy as np

    from triton_disagg.bench.copy_timing import best_gbps

    readv = _libc_process_vm_readv()
    ctx = multiprocessing.get_context("spawn")      # no fork of a process with threads
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_hold, args=(nbytes, theirs), daemon=True)
    child.start()
    theirs.close()
    try:
        if not ours.poll(CHILD_TIMEOUT_S):
            raise RuntimeError(f"the child holding {nbytes} bytes sent no address in "
                               f"{CHILD_TIMEOUT_S:g} s")
        pid, address = child.pid, ours.recv()
        dst = np.zeros(nbytes, np.uint8)
        local, remote = _Iovec(dst.ctypes.data, nbytes), _Iovec(address, nbytes)

        def read() -> None:
            _check(readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0), nbytes, pid)

        read()
        if not np.array_equal(dst, pattern(nbytes)):
            raise RuntimeError(f"process_vm_readv from pid {pid} at {address:#x} read bytes "
                               "other than the child's pattern")
        return best_gbps(read, nbytes, repeats)
    finally:
        ours.close()                                # the child's cue to exit
        child.join(CHILD_TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join()


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 8_192_000
    try:
        print(f"process_vm_readv of {size} bytes from a child: "
              f"{process_vm_readv_gbps(size):.1f} GB/s (best of 50, cache-hot)")
    except Refused as why:
        print(f"process_vm_readv: n/a: {why}")
