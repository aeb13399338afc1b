"""Large requests on Triton's own public gRPC port (issue 27 re-review F5): Triton 2.51 takes
a message of up to 2 GiB before any model runs, and refuses nothing by size. A client may
send them; what tritonserver keeps of them afterwards must stay bounded: by default Triton
keeps up to 8 request objects for reuse, each holding the capacity of the largest message
it carried, so a stream of large requests ratcheted its memory up (200 MiB requests:
+1.7 GiB after 11, still climbing). Serve starts it with
``--grpc-infer-allocation-pool-size=0``. Measured here: tritonserver's resident memory
after ``REQUESTS`` refused requests of ``SIZE`` bytes each stays under ``BOUND`` x ``SIZE``
above what it was before them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import servers

SIZE = 128 * 2**20
REQUESTS = 8
BOUND = 4


def _tritonserver_rss(work_dir: Path) -> int:
    """Resident bytes of the server's tritonserver process."""
    for line in servers.processes_under(work_dir):
        pid = line.split(":", 1)[0]
        if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver":
            status = Path(f"/proc/{pid}/status").read_text()
            return int(next(l.split()[1] for l in status.splitlines()
                            if l.startswith("VmRSS:"))) * 1024
    raise AssertionError("no tritonserver process under the work directory")


def test_large_refused_requests_leave_tritonserver_memory_bounded(demo_engine, tmp_path):
    import tritonclient.grpc as grpcclient

    with servers.serve_config(f"model: {{engine: {demo_engine}}}\n"
                              "kv_cache: {max_size: 16MB}\n", tmp_path) as served:
        before = _tritonserver_rss(served.work_dir)
        text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"a" * SIZE]], dtype=object))
        max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        max_tokens.set_data_from_numpy(np.array([[4]], np.int32))
        with grpcclient.InferenceServerClient(served.grpc) as client:
            for _ in range(REQUESTS):
                try:
                    client.infer("preprocessing", [text, max_tokens])
                    raise AssertionError("a text of 128 MiB was taken")
                except grpcclient.InferenceServerException as exc:
                    assert "more than the" in exc.message(), exc.message()
        grown = _tritonserver_rss(served.work_dir) - before
        assert grown < BOUND * SIZE, f"tritonserver kept {grown / 2**20:.0f} MiB"
