"""The deployment guide on three hosts, run as the README writes it ("The guide's flow"):
each network-namespace host (:mod:`netns_hosts`) is named as the guide names it
(``context-server-01``, ``generation-server-01``, ``scheduler-node``, resolved by every
host as a deployment's DNS would) and runs the README's command for it from a folder with
the guide's ``disagg_config.yaml`` (tests/support/guide_disagg_config.yaml, hostnames and
ports as written: context 8000, generation 8001, the scheduler 8002; its GPUs, which this
host has not, replaced by one core per role) and ``engines/demo``. The guide's request,
the README's ``curl`` line run by bash on a fourth host, answers the offline engine's text
under the served model name ``deepseek-r1``; the context's and generation's ``/healthz`` and
the scheduler's Triton answer on the README's ports table's ports; a clean stop, the
scheduler first, logs no ERROR line. The guide's config names no etcd (static urls), so
none runs here; tests/cluster/test_netns_pools.py covers pools found through etcd.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from pathlib import Path

import servers
from config_files import guide_config_as_written, guide_config_on_cpus
from netns_hosts import Hosts, hosts_fixture, named_hosts

ROOT = Path(__file__).resolve().parents[2]
SERVERS = ("context-server-01", "generation-server-01", "scheduler-node")
HOSTS = (*SERVERS, "client")
GRPC_PORTS = {"context": 8000, "generation": 8001, "scheduler": 8004}   # the README's table
HEALTH_PORTS = {"context": 8081, "generation": 8082}
SCHEDULER_HTTP = 8003
DEFAULT_MAX_TOKENS = 16          # /v1/inference's without max_tokens (OpenAI completions')

hosts = hosts_fixture(HOSTS)


def _the_readmes_guide() -> tuple[str, dict[str, list[str]], str]:
    """The README's guide: its ``disagg_config.yaml`` block, each host's ``serve`` command
    (``# on HOST`` above it) and the request (its ``curl`` line)."""
    readme = (ROOT / "README.md").read_text()
    (config,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "scheduler-node" in b]
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "# on scheduler-node" in b]
    commands, request, host = {}, "", ""
    for line in block.replace("\\\n", " ").splitlines():
        if line.startswith("# on "):
            host = line.split()[2]
        elif line.startswith(".venv/bin/triton-disagg serve "):
            commands[host] = ["triton-disagg", *shlex.split(line)[1:]]
        elif line.startswith("curl "):
            request = line
    return config, commands, request


def _payload(curl: str) -> dict:
    words = shlex.split(curl)
    return json.loads(words[words.index("-d") + 1])


def _curl(hosts: Hosts, command: str) -> str:
    """``command`` run by bash on the client host: its output (it must succeed)."""
    out = hosts.run("client", ["bash", "-c", command], timeout=120)
    assert out.returncode == 0, (command, out.stderr)
    return out.stdout


def test_the_guide_on_three_hosts(demo_engine, tmp_path, hosts, monkeypatch):
    from triton_disagg.kv.secret import SECRET_ENV

    config, commands, request = _the_readmes_guide()
    assert config == guide_config_as_written(), "the README's guide config is not tests/support's"
    assert sorted(commands) == sorted(SERVERS) and "scheduler-node:8002/v1/inference" in request
    monkeypatch.setenv(SECRET_ENV, "netns-guide-" + "7" * 32)   # the README's export
    (tmp_path / "disagg_config.yaml").write_text(guide_config_on_cpus())
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "demo").symlink_to(demo_engine)
    payload = _payload(request)
    expected = servers.offline_text(demo_engine)(payload["prompt"], DEFAULT_MAX_TOKENS)

    def started(host: str) -> tuple:
        role = commands[host][2]
        work_dir = tmp_path / "work" / f"{role}-{hosts.address(host)}-{GRPC_PORTS[role]}"
        cmd = hosts.command(host, servers.cli_argv(commands[host]))
        return cmd, work_dir, None, f"{hosts.address(host)}:{GRPC_PORTS[role]}", None

    with contextlib.ExitStack() as stack:
        stack.enter_context(named_hosts(hosts))
        context, generation = stack.enter_context(servers.serve_commands(
            [started("context-server-01"), started("generation-server-01")], cwd=tmp_path))
        (scheduler,) = stack.enter_context(servers.serve_commands([started("scheduler-node")],
                                                                  cwd=tmp_path))
        front = f"http://{hosts.address('scheduler-node')}:8002"
        assert f"front    {front}" in scheduler.log.read_text()
        answer = json.loads(_curl(hosts, request))
        assert answer.get("text") == expected, answer
        models = json.loads(_curl(hosts, "curl -s http://scheduler-node:8002/v1/models"))
        assert [m["id"] for m in models["data"]] == [payload["model"]], models
        for host, role in (("context-server-01", "context"), ("generation-server-01", "generation")):
            health = _curl(hosts, f"curl -s http://{host}:{HEALTH_PORTS[role]}/healthz")
            assert json.loads(health) == {"status": "ok"}, (role, health)
        ready = _curl(hosts, f"curl -s -o /dev/null -w '%{{http_code}}' "
                             f"http://scheduler-node:{SCHEDULER_HTTP}/v2/health/ready")
        assert ready == "200"
        for served in (scheduler, context, generation):   # the scheduler first: no peer lost
            assert servers.stop(served) == 0
        for served in (context, generation, scheduler):
            text = served.log.read_text() + served.server_log()
            errors = [line for line in text.splitlines() if "ERROR" in line]
            assert not errors, f"{served.work_dir.name}: {errors}"
