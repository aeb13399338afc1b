"""A serving install pulls neither locust nor matplotlib: both are the ``[bench]`` extra's
(pyproject.toml), read here as pip reads them, from the installed distribution's metadata
(``make`` reinstalls whenever pyproject.toml changes)."""

from __future__ import annotations

from importlib.metadata import requires

from packaging.requirements import Requirement

BENCH_ONLY = {"locust", "matplotlib"}


def _requirements() -> list[Requirement]:
    return [Requirement(line) for line in requires("triton-disagg") or []]


def test_a_serving_install_requires_neither_locust_nor_matplotlib():
    core = {r.name.lower() for r in _requirements() if r.marker is None}
    assert {"aiohttp", "nvidia-pytriton", "tritonclient"} <= core     # the metadata was read
    assert core & BENCH_ONLY == set(), core & BENCH_ONLY


def test_the_bench_extra_brings_them_and_the_test_extra_the_bench_extra():
    def extra(name: str) -> dict[str, Requirement]:
        return {r.name.lower(): r for r in _requirements()
                if r.marker is not None and r.marker.evaluate({"extra": name})}

    assert BENCH_ONLY | {"transformers"} <= set(extra("bench"))
    assert extra("test")["triton-disagg"].extras == {"bench"}
    assert "pytest-timeout" in extra("test")
