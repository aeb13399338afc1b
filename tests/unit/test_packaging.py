"""A serving install pulls neither locust nor matplotlib: both are the ``[bench]`` extra's
(pyproject.toml), read here as pip reads them, from the installed distribution's metadata
(``make`` reinstalls whenever pyproject.toml changes); and pyproject names every package
the install ships, so setuptools has nothing to warn about."""

from __future__ import annotations

import re
from importlib.metadata import requires
from pathlib import Path

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


def test_every_model_template_folder_is_a_listed_package():
    """Each ``model_repo/<model>/`` (its ``config.pbtxt`` is package data) is named in
    pyproject's ``packages``, else setuptools prints a screenful of "Package would be
    ignored" warnings at every install, ``make demo``'s first one included."""
    root = Path(__file__).resolve().parents[2]
    pyproject = (root / "pyproject.toml").read_text()     # tomllib is 3.11's; 3.10 is supported
    packages = pyproject.split("\npackages = [", 1)[1].split("\n]", 1)[0]
    listed = set(re.findall(r'"([\w.]+)"', packages))
    models = {f"triton_disagg.model_repo.{p.parent.name}"
              for p in (root / "model_repo").glob("*/config.pbtxt")}
    assert len(models) == 5, models      # context, ensemble, generation, orchestrator, preprocessing
    assert models - listed == set(), models - listed
