"""The bench commands' shared flags (``bench/args.py``): ``--cpus`` is a list of core ids,
0 allowed, anything else refused naming the flag; without it, every core this process may
run on."""

from __future__ import annotations

import os

import pytest

from triton_disagg.bench.args import cpus_arg
from triton_disagg.errors import UserError


def test_cpus_lists_the_cores_named_or_every_usable_one():
    assert cpus_arg("0,2") == [0, 2]
    assert cpus_arg(None) == sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("text", ["", "1,-2", "a,b", "1.5"])
def test_cpus_refuses_what_is_no_core_list_naming_the_flag(text):
    with pytest.raises(UserError, match="^--cpus: expected comma-separated non-negative int"):
        cpus_arg(text)
