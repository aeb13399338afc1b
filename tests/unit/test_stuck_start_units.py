""":class:`StartWatch` (the stub Triton abandoned at its start) on log lines and stub
lists made up here: a model is stuck only when every stub it has finished ``initialize``
long enough ago and Triton never reported it loaded."""

from __future__ import annotations

from triton_disagg.triton.stub_start import initialized_line
from triton_disagg.triton.stub_watch import Stub
from triton_disagg.triton.stuck_start import StartWatch, model_of

LOADED = 'I1206 03:09:36.587912 10800 model_lifecycle.cc:839] "successfully loaded \'{}\'"'


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(stubs: list[Stub]) -> tuple[StartWatch, Clock]:
    clock = Clock()
    return StartWatch(1, stuck_after=30.0, stubs=lambda pid: list(stubs), clock=clock), clock


def test_model_of_strips_group_and_index():
    assert model_of("generation_0_1") == "generation"
    assert model_of("my_model_2_0") == "my_model"


def test_a_finished_stub_whose_model_never_loads_is_stuck_after_the_wait():
    stubs = [Stub(11, "context_0_0"), Stub(12, "generation_0_0")]
    watch, clock = _watch(stubs)
    watch.read(initialized_line("context_0_0", 2.0))
    watch.read(LOADED.format("context"))
    watch.read(initialized_line("generation_0_0", 3.0))
    clock.now += 29.0
    assert watch.stuck() == []
    clock.now += 2.0
    assert watch.stuck() == [Stub(12, "generation_0_0")]


def test_a_model_with_a_stub_still_initializing_is_not_stuck():
    stubs = [Stub(12, "generation_0_0"), Stub(13, "generation_0_1")]
    watch, clock = _watch(stubs)
    watch.read(initialized_line("generation_0_0", 3.0))
    clock.now += 600.0
    assert watch.stuck() == []
    watch.read(initialized_line("generation_0_1", 3.0))
    clock.now += 31.0
    assert watch.stuck() == stubs


def test_a_loaded_model_is_never_stuck():
    watch, clock = _watch([Stub(12, "generation_0_0")])
    watch.read(initialized_line("generation_0_0", 3.0))
    watch.read(LOADED.format("generation"))
    clock.now += 600.0
    assert watch.stuck() == []
