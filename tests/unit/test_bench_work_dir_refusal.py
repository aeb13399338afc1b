"""The bench starts tritonserver through ``launch.deploy.start``, not ``serve``: a work
directory another local user could change is refused there too
(:func:`launch.work_dir.refuse_replaceable`; serve's side: ``test_work_dir.py``). Nothing
is rendered or started."""

from __future__ import annotations

import pytest

from triton_disagg.errors import UserError
from triton_disagg.triton import private_shm


def test_the_bench_deploy_path_refuses_a_work_dir_others_can_replace(demo_engine, tmp_path,
                                                                     monkeypatch):
    """Review item 11: `bench serve` and `bench soak` reach ``deploy.start`` with
    ``--work-dir`` and never ``serve``'s claim; under a directory every user may write
    (not sticky), another user could swap the rendered model repository tritonserver runs."""
    from triton_disagg.bench.serve_servers import serving
    from triton_disagg.triton.tritonserver import TritonServer

    def started(self):
        raise AssertionError("tritonserver started from a work dir others can replace")
    monkeypatch.setattr(TritonServer, "start", started)
    monkeypatch.setattr(private_shm, "refuse_shared", lambda: None)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError) as refused:
        with serving("aggregated", demo_engine, [0], shared / "bench-serve"):
            pass
    (line,) = str(refused.value).splitlines()
    assert f"every user may write {shared}" in line and "--work-dir" in line, line
    assert not (shared / "bench-serve" / "aggregated" / "model_repository").exists()
