"""The bench starts tritonserver through ``launch.deploy.start``, not ``serve``: on a host
that allows it no ``/dev/shm`` of its own it refuses the same way
(:func:`triton_disagg.triton.private_shm.refuse_shared`; serve's side:
``test_shared_shm_refusal.py``). The fallback is simulated, and nothing is started."""

from __future__ import annotations

import pytest

from triton_disagg.errors import UserError
from triton_disagg.triton import private_shm
from triton_disagg.triton.private_shm import ALLOW_SHARED_ENV


def test_the_bench_deploy_path_refuses_the_shared_dev_shm_too(demo_engine, tmp_path,
                                                             monkeypatch):
    """`bench serve` and `bench handoff` start tritonserver through ``launch.deploy.start``,
    not ``serve``: the same refusal, before anything is rendered or started."""
    from triton_disagg.bench.serve_servers import serving
    from triton_disagg.triton.tritonserver import TritonServer

    def started(self):
        raise AssertionError("tritonserver started on the shared /dev/shm")
    monkeypatch.setattr(TritonServer, "start", started)
    monkeypatch.setattr(private_shm, "possible", lambda: False)
    monkeypatch.delenv(ALLOW_SHARED_ENV, raising=False)
    with pytest.raises(UserError, match=f"{ALLOW_SHARED_ENV}=1"):
        with serving("aggregated", demo_engine, [0], tmp_path / "work"):
            pass
    assert not (tmp_path / "work").exists()
