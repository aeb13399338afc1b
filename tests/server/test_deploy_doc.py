"""docs/deploy.md matches the code: its ``launch k8s`` commands (and the README's) run as
written from a checkout and render objects that validate with zero schema errors; its
per-host ``serve`` lines are the command line :func:`serve_argv` writes, on the ports the
pods use; its ``kubernetes:`` block shows the defaults the config code applies. (Its
``kubectl`` and ``docker`` lines need a cluster and Docker, and are not run.)"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from k8s_manifests import schema_errors
from triton_disagg.cli import build_parser
from triton_disagg.config.kubernetes import KubernetesConfig, parse_kubernetes
from triton_disagg.launch.k8s_workloads import PORTS
from triton_disagg.launch.serve_argv import serve_argv

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "deploy.md").read_text()
README = (ROOT / "README.md").read_text()


def _bash_lines(prefix: str, text: str = DOC) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith(prefix)]


def test_render_commands_run_as_written_and_validate(tmp_path):
    commands = _bash_lines(".venv/bin/triton-disagg launch k8s ")
    assert len(commands) >= 2, "docs/deploy.md lost its render commands"
    commands += _bash_lines(".venv/bin/triton-disagg launch k8s ", README)
    shutil.copy(ROOT / "disagg_config.yaml", tmp_path)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")   # no engines/: not needed
    for command in commands:
        argv = shlex.split(command)
        done = subprocess.run([sys.executable, "-m", "triton_disagg.cli", *argv[1:]],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{command}\n{done.stderr}"
        out = tmp_path / argv[argv.index("--out") + 1]
        objects = {p.name: yaml.safe_load(p.read_text()) for p in out.glob("*.yaml")}
        assert len(objects) > 10 and schema_errors(objects) == [], command
        assert ("kustomization.yaml" in objects) == ("--kustomize" in argv)
        shutil.rmtree(out)              # the README's command renders into the same folder


def test_per_host_serve_lines_are_serve_argv_on_the_pods_ports():
    lines = _bash_lines("triton-disagg serve ")
    assert sorted(shlex.split(line)[2] for line in lines) == ["context", "generation", "scheduler"]
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line)
        args = parser.parse_args(argv[1:])
        ports = PORTS[args.role]
        assert (args.http_port, args.grpc_port, args.metrics_port, args.front_port) == (
            ports["http"], ports["grpc"], ports["metrics"], ports["front"]), line
        assert argv == serve_argv(args.role, str(args.config), args.host, args.grpc_port,
                                  args.metrics_port, args.http_port, args.advertise,
                                  args.front_port), line


def test_the_kubernetes_block_shows_the_defaults():
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", DOC, re.S) if "kubernetes:" in b]
    shown = parse_kubernetes(yaml.safe_load(block)["kubernetes"])
    defaults = parse_kubernetes(None)
    assert shown.name == defaults.name == KubernetesConfig.name
    for key in ("engine_pvc", "etcd", "etcd_image", "kv_secret"):
        assert getattr(shown, key) == getattr(defaults, key), key
    for role in ("context", "generation", "scheduler"):
        assert shown.scale(role) == defaults.scale(role), role
