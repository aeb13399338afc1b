"""Servers of one role on one host, started from one directory with no ``--work-dir``
(launch/work_dir.py): two context servers (127.0.0.2, 127.0.0.3) and two generation
servers (127.0.0.4, 127.0.0.5) each get a work directory of their own and become ready,
and a scheduler routing over both pools serves 32 of 32 streams with the offline engine's
text, both context servers taking a share. A third ``serve`` told to use a work directory
in use refuses in one line naming ``--work-dir``, and the first keeps serving.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import servers

STREAMS, MAX_TOKENS = 32, 12
HOSTS = {("context", 0): "127.0.0.2", ("context", 1): "127.0.0.3",
         ("generation", 0): "127.0.0.4", ("generation", 1): "127.0.0.5"}


def _context_requests(metrics_url: str) -> float:
    text = servers.metrics(metrics_url)
    return sum(float(v) for v in re.findall(
        r'^nv_inference_request_success\{model="context",[^}]*\} (\S+)$', text, re.M))


def test_two_servers_of_each_role_from_one_directory(demo_engine, tmp_path):
    ports = dict(zip(HOSTS, servers.free_ports(len(HOSTS))))
    fronts = dict(zip(HOSTS, servers.free_ports(len(HOSTS))))
    metrics = dict(zip(HOSTS, servers.free_ports(len(HOSTS))))
    urls = {role: ", ".join(f'"{HOSTS[key]}:{ports[key]}"' for key in HOSTS if key[0] == role)
            for role in ("context", "generation")}
    (tmp_path / "disagg_config.yaml").write_text(
        f"model: {{engine: {demo_engine}}}\n"
        f"context_server: {{urls: [{urls['context']}]}}\n"
        f"generation_server: {{urls: [{urls['generation']}]}}\n"
        "kv_cache: {strategy: direct_transfer, max_size: 32MB}\n")

    def command(role: str, host: str, grpc: int, *extra: str) -> list[str]:
        return servers.cli_argv(["triton-disagg", "serve", role, "-c", "disagg_config.yaml",
                                 "--host", host, "--grpc-port", str(grpc), *extra])

    work = tmp_path / "work"
    roles = [(command(key[0], HOSTS[key], ports[key], "--front-port", str(fronts[key]),
                      "--metrics-port", str(metrics[key])),
              work / f"{key[0]}-{HOSTS[key]}-{ports[key]}", None, f"{HOSTS[key]}:{ports[key]}",
              f"http://{HOSTS[key]}:{metrics[key]}") for key in HOSTS]
    http, grpc, front, sched_metrics = servers.free_ports(4)
    scheduler = (command("scheduler", "127.0.0.1", grpc, "--http-port", str(http),
                         "--front-port", str(front), "--metrics-port", str(sched_metrics)),
                 work / f"scheduler-127.0.0.1-{grpc}", f"http://127.0.0.1:{http}",
                 f"127.0.0.1:{grpc}", None)
    offline = servers.offline_text(demo_engine)
    prompts = [f"{servers.PROMPTS[i % 4]} {i}" for i in range(STREAMS)]
    with servers.serve_commands(roles, cwd=tmp_path) as started, \
            servers.serve_commands([scheduler], cwd=tmp_path) as (sched,):
        assert len({s.work_dir for s in started}) == 4
        assert all((s.work_dir / "model_repository").is_dir() for s in started)
        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(
                lambda p: "".join(servers.grpc_stream(sched.grpc, p, MAX_TOKENS)), prompts))
        served = sum(text == offline(p, MAX_TOKENS) for p, text in zip(prompts, texts))
        assert served == STREAMS, [(p, t) for p, t in zip(prompts, texts)
                                   if t != offline(p, MAX_TOKENS)]
        shares = [_context_requests(s.metrics) for s in started[:2]]
        assert all(share > 0 for share in shares), shares

        taken = started[0]
        again = subprocess.run(command("context", HOSTS[("context", 0)], ports[("context", 0)],
                                       "--work-dir", str(taken.work_dir)),
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert again.returncode != 0, again
        (line,) = again.stderr.strip().splitlines()
        assert "--work-dir" in line and "in use" in line, line
        text = "".join(servers.grpc_stream(sched.grpc, prompts[0], MAX_TOKENS))
        assert text == offline(prompts[0], MAX_TOKENS)
