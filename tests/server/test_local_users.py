"""What another local user of the host can do (docs/architecture.md, "Trust boundaries"),
on real tritonservers.

Every local user reads a process's command line (``/proc/<pid>/cmdline`` is 0444), so the
scheduler's tritonserver command line is read and every value on it sent as the
restricted-API header: Triton's model-load API refuses (model control is off: no load over
the network; the uploaded model.py never runs), and the shared-memory API cannot open a
project entry of the host's ``/dev/shm`` (Triton's ``/dev/shm`` is its own). A server's
Python-backend regions are not in the host's ``/dev/shm`` at all: they are in a private
tmpfs of mode 0700, gone with the server; the project's KV staging areas are 0600.
``serve all`` bound to 127.0.0.1 listens on loopback alone: UCX, under NIXL in the stubs,
would listen on every interface. The restricted-API header's name holds a ``:``, so no
client can send it (raw HTTP/2 included): the value on the command line opens nothing, not
even Triton's own Python-backend regions, whose names the stubs' command lines show.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import signal
import socket
import stat
import urllib.error
import urllib.request

import servers
from test_shm import ECHO, start_echo_server
from triton_disagg import shm
from triton_disagg.kv.host_memory import HostStaging
from triton_disagg.triton.tritonserver import RESTRICTED_HEADER

EVIL = "import os\nos.system('touch /tmp/triton_disagg_pwned')\n" + ECHO


def _post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _command_line_headers(pid: int) -> set[tuple[str, str]]:
    """Every header a local user may make of ``pid``'s command line and send: the part of
    ``RESTRICTED_HEADER``'s name a client can send (up to its ``:``) set to each word of it
    (split at ``= : ,`` too) and to the rest of the name joined to each word, and each
    ``name=value`` in it."""
    argv = servers.argv(pid)
    words = {word for arg in argv for word in re.split(r"[=:,]", arg) + [arg] if word}
    pairs = {m.groups() for arg in argv for m in re.finditer(r"([\w-]+)=([^,:=\s]+)", arg)}
    head, _, tail = RESTRICTED_HEADER.partition(":")
    made = {(head, value) for word in words if word.isprintable()
            for value in (word, f"{tail}={word}", f"{tail}:{word}")}
    return made | pairs


def _python_backend_regions(work_dir) -> set[str]:
    """The shared-memory regions Triton's Python-backend stubs under ``work_dir`` name on
    their command lines (``triton_python_backend_stub MODEL REGION ...``), as ``ps`` shows."""
    stubs = [servers.argv(int(line.split(":")[0])) for line in servers.processes_under(work_dir)]
    return {argv[2] for argv in stubs if argv[0].endswith("triton_python_backend_stub")}


def _raw_grpc_status(port: int, key: str, value: str) -> str:
    """What tritonserver's gRPC endpoint says to a SystemSharedMemoryStatus call carrying
    the metadata ``key`` as a raw HTTP/2 client sends it (no gRPC library, which would refuse
    the key itself): its grpc-status, or how the stream or connection ended."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                              (":path", "/inference.GRPCInferenceService/SystemSharedMemoryStatus"),
                              ("content-type", "application/grpc"), ("te", "trailers"),
                              (key, value)])
        conn.send_data(1, b"\0\0\0\0\0", end_stream=True)      # one empty message
        sock.sendall(conn.data_to_send())
        status = "no answer"
        while data := sock.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    status = dict(event.headers).get(b"grpc-status", b"?").decode()
                elif isinstance(event, h2.events.StreamReset):
                    return "reset"
                elif isinstance(event, h2.events.ConnectionTerminated):
                    return "goaway"
                elif isinstance(event, h2.events.StreamEnded):
                    return status
            sock.sendall(conn.data_to_send())
    return status


def test_the_scheduler_command_line_grants_nothing(demo_engine, tmp_path):
    ctx_port, gen_port = servers.free_ports(2)
    config = tmp_path / "disagg_config.yaml"
    config.write_text(f"model: {{engine: {demo_engine}}}\n"
                      f'context_server: {{url: "127.0.0.1:{ctx_port}"}}\n'
                      f'generation_server: {{url: "127.0.0.1:{gen_port}"}}\n')
    probe = shm.new_name("kv", "probe")           # an entry of the host's /dev/shm, as ours
    with open(os.path.join(shm.SHM_DIR, probe), "wb") as f:
        f.truncate(4096)
    try:
        with servers.serve("scheduler", ["-c", str(config)], tmp_path / "s",
                           until="up (") as scheduler:
            triton = servers.tritonserver_pid(scheduler.work_dir)
            headers = _command_line_headers(triton)
            assert len(headers) > 20, headers
            # Triton's own Python-backend regions, named on the stubs' command lines: with a
            # restricted-API header sendable from what ps shows, a local user registered one
            # and read and wrote every request's tensors through inference (issue 27 rev27b)
            regions = _python_backend_regions(scheduler.work_dir)
            assert regions, servers.processes_under(scheduler.work_dir)
            model = {"parameters": {"config": json.dumps({"backend": "python"}),
                                    "file:1/model.py": base64.b64encode(EVIL.encode()).decode()}}
            shm_region = {"key": probe, "offset": 0, "byte_size": 4096}
            for name, value in sorted(headers):
                status, body = _post(f"{scheduler.http}/v2/repository/models/evil/load",
                                     model, {name: value})
                assert status != 200, (name, value, body)
                status, body = _post(
                    f"{scheduler.http}/v2/systemsharedmemory/region/probe/register",
                    shm_region, {name: value})
                assert status != 200, (name, value, body)
                for region in regions:
                    status, body = _post(
                        f"{scheduler.http}/v2/systemsharedmemory/region/r/register",
                        {"key": region, "offset": 0, "byte_size": 4096}, {name: value})
                    assert status != 200, (name, value, region, body)
            # over gRPC, the whole name as a raw HTTP/2 client can put it: refused
            value = servers.tritonserver_flag(scheduler.work_dir,
                                              "grpc-restricted-protocol").rsplit("=", 1)[1]
            grpc_port = int(scheduler.grpc.rsplit(":", 1)[1])
            assert _raw_grpc_status(grpc_port, f"triton-grpc-protocol-{RESTRICTED_HEADER}",
                                    value) != "0"
            assert not os.path.exists("/tmp/triton_disagg_pwned")
            # serve's umask: the logs it, tritonserver and the front write (request ids, errors,
            # internal addresses) are its user's alone (the test made serve-cli.log itself)
            logs = [p for p in scheduler.work_dir.rglob("*.log") if p != scheduler.log]
            assert len(logs) >= 2, logs
            readable = [(str(p), oct(p.stat().st_mode)) for p in logs if p.stat().st_mode & 0o077]
            assert readable == [], readable
            assert not (scheduler.work_dir / "model_repository" / "evil").exists()
    finally:
        os.unlink(os.path.join(shm.SHM_DIR, probe))


def test_python_backend_regions_and_staging_areas_are_private(tmp_path):
    server = start_echo_server(tmp_path)
    try:
        assert server.wait_ready(timeout=120)
        in_host = [n for n in os.listdir("/dev/shm") if n.startswith(server.shm_prefix)]
        assert not in_host, f"Python-backend regions in the host's /dev/shm: {in_host}"
        regions = [n for n in os.listdir(server.regions_dir) if n.startswith(server.shm_prefix)]
        assert regions, "no Python-backend region found"
        # boost.interprocess makes each region 0644 whatever the umask; the folder is 0700
        assert stat.S_IMODE(os.stat(server.regions_dir).st_mode) == 0o700
        # rev27f L1: UCX's SysV segments (0660) live in the server's own IPC namespace
        assert os.readlink(f"/proc/{server.process.pid}/ns/ipc") != \
            os.readlink("/proc/self/ns/ipc")
        os.killpg(server.process.pid, signal.SIGKILL)   # tritonserver and its stubs
        server.process.wait(60)
    finally:
        server.stop()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(server.shm_prefix)]
    area = HostStaging.create("mode", 2, 64)
    try:
        assert stat.S_IMODE(os.stat(area.path).st_mode) == 0o600
    finally:
        area.close()



def _tcp_listeners(pids: set[int]) -> set[str]:
    """``address:port`` of every TCP socket in LISTEN state that one of ``pids`` holds."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:             # gone meanwhile
            continue
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in open(f"/proc/net/{table}").read().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:          # 0A: LISTEN
                hexaddr, port = fields[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host order
                found.add(f"{socket.inet_ntop(family, raw)}:{int(port, 16)}")
    return found


def test_serve_all_on_loopback_listens_on_loopback_alone(demo_engine, tmp_path):
    with servers.serve_config(f"model: {{engine: {demo_engine}}}\n"
                              "kv_cache: {strategy: direct_transfer, max_size: 16MB}\n",
                              tmp_path) as served:
        status, body = servers.generate(served.http, {"text_input": "The quick", "max_tokens": 4})
        assert status == 200, body
        under = servers.processes_under(served.work_dir)
        pids = {served.process.pid} | {int(line.split(":")[0]) for line in under}
        listeners = _tcp_listeners(pids)
        stubs = {int(line.split(":")[0]) for line in under if "python_backend_stub" in line}
        # rev27f M2: UCX's TCP listener on 127.0.0.1 took any local user; serve all's NIXL
        # peers are stubs of one tritonserver and use shared memory alone
        assert stubs and not _tcp_listeners(stubs), _tcp_listeners(stubs)
    assert len(listeners) >= 4, listeners        # HTTP, gRPC, metrics, the front, ...
    elsewhere = {a for a in listeners
                 if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback
                 and a.rsplit(":", 1)[0] != "::ffff:127.0.0.1"}
    assert not elsewhere, f"listening beyond loopback: {sorted(elsewhere)}"
