"""scripts/gpu_check.py, section "nixl": a READ of a device buffer from another process (UCX,
VRAM; DRAM on CPU) beside a device-to-device copy of the same bytes in one process.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from gpu_check_speed import copy_bandwidth


def _nixl_owner(device: str, nbytes: int, conn) -> None:
    """The other process: a registered buffer on ``device``; sends its metadata and
    address, then waits until told to stop."""
    from nixl._api import nixl_agent, nixl_agent_config

    buf = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    agent = nixl_agent("owner", nixl_agent_config(backends=["UCX"]))
    kind = "VRAM" if device == "cuda" else "DRAM"
    dev_id = buf.device.index or 0
    agent.register_memory([(buf.data_ptr(), nbytes, dev_id, "")], kind)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), dev_id))
    conn.recv()


def nixl_table(device: str, nbytes: int, repeats: int, say) -> list[str]:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        return [f"NIXL not importable here ({exc}); carry the nixl wheel to run this section."]
    kind = "VRAM" if device == "cuda" else "DRAM"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    owner = ctx.Process(target=_nixl_owner, args=(device, nbytes, there), daemon=True)
    owner.start()
    try:
        metadata, remote_addr, remote_dev = here.recv()
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        agent = nixl_agent("reader", nixl_agent_config(backends=["UCX"]))
        local_dev = dst.device.index or 0
        agent.register_memory([(dst.data_ptr(), nbytes, local_dev, "")], kind)
        peer = agent.add_remote_agent(metadata)
        best_read = float("inf")
        for attempt in range(repeats + 1):
            xfer = agent.initialize_xfer(
                "READ", agent.get_xfer_descs([(dst.data_ptr(), nbytes, local_dev)], kind),
                agent.get_xfer_descs([(remote_addr, nbytes, remote_dev)], kind), peer)
            start = time.perf_counter()
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            elapsed = time.perf_counter() - start
            agent.release_xfer_handle(xfer)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ ended in state {state}")
            if attempt:
                best_read = min(best_read, elapsed)
        if int(dst[-1]) != 7:
            raise RuntimeError("NIXL READ finished but the bytes did not arrive")
        local_copy = 2 / copy_bandwidth(device, nbytes) * nbytes   # seconds for one copy
    finally:
        here.send("stop")
        owner.join(timeout=30)
    lines = [f"{nbytes / 2**20:,.0f} MiB of {kind}; best of {repeats} after a warm-up.", "",
             "| transfer | seconds | GB/s (bytes moved / s) |", "|---|---:|---:|",
             f"| NIXL READ from another process (UCX, {kind}) | {best_read:.4f} | "
             f"{nbytes / best_read / 1e9:,.1f} |",
             f"| copy within one process ({device}) | {local_copy:.4f} | "
             f"{nbytes / local_copy / 1e9:,.1f} |"]
    for line in lines[-2:]:
        say(line)
    return lines
