"""`bench handoff`'s kernel-copy bound: process_vm_readv reads a child's bytes into this
process, checked against the child's pattern, and times it with memcpy's harness."""

from __future__ import annotations

import ctypes
import errno

import numpy as np
import pytest

from triton_disagg.bench import cross_process_copy
from triton_disagg.bench.copy_timing import best_gbps
from triton_disagg.bench.cross_process_copy import Refused, pattern, process_vm_readv_gbps


def test_pattern_is_not_page_periodic():
    p = pattern(3 * 4096)
    assert p.shape == (3 * 4096,) and p.dtype == np.uint8
    assert not np.array_equal(p[:4096], p[4096:8192])      # a page-shifted read would differ


@pytest.mark.parametrize("nbytes", [262_144, 8_192_000])
def test_reads_the_childs_pattern_across_processes(nbytes):
    """The parent reads its own child, which even Yama's ptrace_scope 1 allows: a refusal
    here is a failure, not a skip."""
    assert process_vm_readv_gbps(nbytes, repeats=5) > 0    # raises unless the bytes match


def test_bytes_other_than_the_childs_fail_loudly(monkeypatch):
    """The spawned child fills its buffer with the real pattern; the parent here expects
    another, so the read-back check must raise rather than time anything."""
    real = cross_process_copy.pattern
    monkeypatch.setattr(cross_process_copy, "pattern", lambda n: real(n) + np.uint8(1))
    with pytest.raises(RuntimeError, match="other than the child's pattern"):
        process_vm_readv_gbps(4096, repeats=1)


def test_refusing_errnos_become_refused_with_the_reason_others_raise():
    ctypes.set_errno(errno.EPERM)
    with pytest.raises(Refused, match="EPERM.*ptrace"):
        cross_process_copy._check(-1, 4096, 1)
    ctypes.set_errno(errno.EFAULT)
    with pytest.raises(OSError, match="Bad address"):
        cross_process_copy._check(-1, 4096, 1)
    with pytest.raises(OSError, match="short read"):
        cross_process_copy._check(100, 4096, 1)
    cross_process_copy._check(4096, 4096, 1)


def test_best_gbps_is_the_fastest_call_after_warmup():
    calls = []
    assert best_gbps(lambda: calls.append(1), 1000, repeats=3, warmup=2) > 0
    assert len(calls) == 5
