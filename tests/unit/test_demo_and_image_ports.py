"""`make demo` and the Docker image against what `serve` does: the demo's recipe sets every
port `serve` opens from a Makefile variable (so `make demo X_PORT=...` moves them all, as the
README says); the cpu image installs the `[cpu]` extra (no CUDA torch), exposes and publishes
every port `serve all` opens, the OpenAI front's included; the Dockerfile and docs/deploy.md
say what engine/runtime.py does on a GPU (torch on CUDA), not that it stays numpy on the CPU;
both images end as the non-root user the Kubernetes pods ask for (launch k8s's RUN_AS), who
owns the work directory serve writes."""

from __future__ import annotations

import re
from pathlib import Path

from triton_disagg.cli import build_parser
from triton_disagg.launch.deploy import DEFAULT_PORTS
from triton_disagg.launch.front_process import DEFAULT_FRONT_PORTS
from triton_disagg.launch.k8s_workloads import POD_SECURITY, RUN_AS
from triton_disagg.launch.work_dir import default as default_work_dir

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()
DOCKERFILE = (ROOT / "Dockerfile").read_text()
DEPLOY = (ROOT / "docs" / "deploy.md").read_text()
README = (ROOT / "README.md").read_text()
SERVE_ALLS_PORTS = {*DEFAULT_PORTS.values(), DEFAULT_FRONT_PORTS["all"]}


def _serve_port_flags() -> set[str]:
    (serve,) = [action.choices["serve"] for action in build_parser()._subparsers._actions
                if getattr(action, "choices", None) and "serve" in action.choices]
    return {flag for action in serve._actions for flag in action.option_strings
            if flag.endswith("-port")}


def test_make_demo_sets_every_port_serve_opens():
    recipe = MAKEFILE.split("\ndemo:", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    given = dict(re.findall(r"(--[\w-]+-port) \$\((\w+)\)", recipe))
    assert set(given) == _serve_port_flags(), recipe
    defaults = dict(re.findall(r"^(\w+_PORT) +\?= *(\d+)", MAKEFILE, re.M))
    assert set(given.values()) <= set(defaults), defaults
    assert {int(defaults[v]) for v in given.values()} == SERVE_ALLS_PORTS
    (moved,) = re.findall(r"`make\s+demo ([^`]*)` moves the demo's ports", README)
    assert {word.split("=")[0] for word in moved.split()} == set(given.values()), moved


def test_the_cpu_image_installs_the_cpu_extra_and_publishes_every_port():
    cpu = DOCKERFILE.split("AS cpu", 1)[1].split("\nFROM ", 1)[0]
    installs = re.findall(r"pip install [^\n]*", cpu)
    assert any('".[cpu]"' in line or "'.[cpu]'" in line for line in installs), installs
    assert not any(re.search(r"pip install --no-cache-dir \.(\s|$)", line) for line in installs)
    (exposed,) = re.findall(r"^EXPOSE (.*)$", cpu, re.M)
    assert {int(p) for p in exposed.split()} == SERVE_ALLS_PORTS
    for text in (DOCKERFILE, DEPLOY):
        (run,) = [line for line in text.splitlines() if "docker run" in line and ":cpu" in line]
        published = {int(p) for p in re.findall(r"-p (\d+):\d+", run)}
        assert published == SERVE_ALLS_PORTS, run


def test_the_image_and_deploy_docs_say_what_the_runtime_does_on_a_gpu():
    gpu_section = DEPLOY.split("## What differs on GPU nodes", 1)[1]
    for text in (DOCKERFILE, gpu_section):
        assert "torch on CUDA" in text and "Runtime.default" in text
        assert not re.search(r"numpy (reference )?engine (and runs )?on the CPU", text)


def test_each_image_installs_the_extra_the_readme_gives_its_host():
    """The README's install table: `[cpu]` for a host without a GPU, `[gpu]` for a CUDA host;
    the gpu image is the CUDA host's."""
    table = README.split("### What each install pulls", 1)[1].split("\n\n", 2)[1]
    assert re.search(r'`pip install "\.\[gpu\]"`[^|]*\| a CUDA host', table), table
    gpu = DOCKERFILE.split("AS gpu", 1)[1]
    installs = re.findall(r"pip install [^\n]*", gpu)
    assert installs and all('".[gpu]"' in line for line in installs), installs


def test_the_images_opt_in_to_a_shared_dev_shm_only_off_the_hosts_ipc():
    from triton_disagg.triton.private_shm import ALLOW_SHARED_ENV, CONTAINER_ONLY

    settings = re.findall(rf"{ALLOW_SHARED_ENV}=(\w+)", DOCKERFILE.split("\nFROM ", 1)[1])
    assert settings == [CONTAINER_ONLY, CONTAINER_ONLY], settings      # cpu and gpu targets
    assert "--ipc=host" in DEPLOY and f"{ALLOW_SHARED_ENV}={CONTAINER_ONLY}" in DEPLOY


def test_make_and_the_cpu_image_take_cpu_torch_from_pytorchs_cpu_index():
    """On public PyPI ``[cpu]``'s torch pin is the CUDA build: `make` (the venv every make
    target uses) and the cpu image install that pin from PyTorch's CPU index first."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (pin,) = [d for d in extras["cpu"] if d.startswith("torch")]
    cpu_index = "https://download.pytorch.org/whl/cpu"
    assert re.search(rf"^TORCH_CPU\s+:= {re.escape(pin)}$", MAKEFILE, re.M)
    assert re.search(rf"^TORCH_CPU_INDEX \?= {re.escape(cpu_index)}$", MAKEFILE, re.M)
    venv = MAKEFILE.split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert venv.index("--index-url $(TORCH_CPU_INDEX)") < venv.index('-e ".[cpu]"'), venv
    cpu = DOCKERFILE.split("AS cpu", 1)[1].split("\nFROM ", 1)[0]
    assert f"--index-url {cpu_index} {pin}" in cpu


def test_both_images_run_as_the_pods_non_root_user_who_owns_the_work_dir():
    """The images once had no USER: serve ran as root in them and in the pods."""
    assert RUN_AS != 0 and POD_SECURITY["runAsNonRoot"] is True
    assert POD_SECURITY["runAsUser"] == POD_SECURITY["runAsGroup"] == POD_SECURITY["fsGroup"] == RUN_AS
    work = default_work_dir("all", "0.0.0.0", 8001).parts[0]     # serve's, under WORKDIR
    for stage in DOCKERFILE.split("\nFROM ")[1:]:
        instructions = re.findall(r"^([A-Z]+) ", stage, re.M)
        assert instructions[-3:] == ["USER", "EXPOSE", "CMD"], stage   # no RUN after USER
        assert re.findall(r"^USER (.*)$", stage, re.M) == [f"{RUN_AS}:{RUN_AS}"]
        assert f"--uid {RUN_AS} --gid {RUN_AS}" in stage and f"groupadd --gid {RUN_AS}" in stage
        assert f"install -d -o {RUN_AS} -g {RUN_AS} {work}\n" in stage
