"""The README's examples work as written: its Python snippets and docs/clients.md's run
against a real `serve all` of the demo engine (the plain ``infer()`` one against a server
with ``decoupled_mode: false``) and print the offline engine's text; the three-role
commands run as written with examples/three_roles.yaml and give `serve all`'s text;
the example disagg_config.yaml at the repository root loads."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import requests

import servers

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CLIENTS_DOC = (ROOT / "docs" / "clients.md").read_text()     # the Triton clients' examples
PROMPT, MAX_TOKENS = "The quick brown fox", 20


def _on_ports(code: str, served: servers.Served, model: str = "demo") -> str:
    """The README's default ports replaced by the test server's, and its model id
    (``demo``, the name of ``engines/demo``) by ``model``, the test engine directory's."""
    http_port = served.http.rsplit(":", 1)[1]
    grpc_port = served.grpc.rsplit(":", 1)[1]
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{http_port}").replace(
        "127.0.0.1:8001", f"127.0.0.1:{grpc_port}").replace('"demo"', f'"{model}"')
    return code.replace("http://127.0.0.1:8080", served.front) if served.front else code


def _plain_infer(code: str) -> bool:
    return ".infer(" in code


def _run_snippets(snippets: list[str], served: servers.Served, expected: str,
                  model: str) -> None:
    for code in snippets:
        assert PROMPT in code
        out = subprocess.run([sys.executable, "-c", _on_ports(code, served, model)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected.strip(), code


def test_readme_examples_print_the_offline_text(demo_engine, tmp_path):
    """Its Python snippets and docs/clients.md's (tritonclient, requests, the openai SDK
    against the HTTP front) print the offline text; its curl lines against the front answer
    as they should."""
    snippets = re.findall(r"```python\n(.*?)```", README + CLIENTS_DOC, re.S)
    plain = [code for code in snippets if _plain_infer(code)]
    assert len(snippets) - len(plain) >= 4 and plain, "the README lost its client examples"
    assert any("from openai import OpenAI" in code for code in snippets)
    expected = servers.offline_text(demo_engine)(PROMPT, MAX_TOKENS)
    model = demo_engine.name
    with servers.serve("all", ["--engine", str(demo_engine)], tmp_path / "run") as served:
        _run_snippets([code for code in snippets if not _plain_infer(code)], served, expected,
                      model)
        _run_front_curls(served, model, expected)
    with servers.serve_config(f"model: {{engine: {demo_engine}}}\ndecoupled_mode: false\n",
                              tmp_path / "plain") as served:
        _run_snippets(plain, served, expected, model)


def _run_front_curls(served: servers.Served, model: str, expected: str) -> None:
    """The README's curl lines to the front (port 8080), run by bash as written."""
    import json

    curls = [c.replace("\\\n", " ") for c in
             re.findall(r"^curl [^\n]*8080(?:[^\n]*\\\n)*[^\n]*$", README, re.M)]
    assert len(curls) >= 4, curls
    for curl in curls:
        out = subprocess.run(["bash", "-c", _on_ports(curl, served, model)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout, (curl, out.stderr)
        if '"stream": true' in curl:
            assert out.stdout.rstrip().endswith("data: [DONE]"), out.stdout
        elif "/v1/completions" in curl:
            assert json.loads(out.stdout)["choices"][0]["text"] == expected
        elif "/v1/inference" in curl:
            assert json.loads(out.stdout)["text"]
        else:
            assert json.loads(out.stdout) == {"status": "ok"}


def _three_roles_here(base: int, health: list[int]) -> str:
    """examples/three_roles.yaml with its ports 8000-8002 moved to ``base``.. (its scheduler's
    tritonserver follows: base+3..+5) and the context's and generation's health fronts
    (8081 / 8082 by default) on ``health``: fixed ports may be taken on a shared host."""
    text = (ROOT / "examples" / "three_roles.yaml").read_text()
    text = re.sub(r"localhost:(800[0-2])", lambda m: f"localhost:{base + int(m.group(1)) - 8000}",
                  text)
    for role, port in zip(("context", "generation"), health):
        text = re.sub(rf"^({role}_server: +{{.*)}}$", rf"\1, front_port: {port}}}", text,
                      flags=re.M)
    assert text.count("front_port:") == 2, text
    return text


def test_three_role_commands_as_written_give_serve_alls_text(demo_engine, tmp_path):
    """The README's three commands, run as written from a checkout with engines/demo built,
    against `serve all`'s text; examples/three_roles.yaml's ports (the guide's 8000-8002, the
    scheduler's tritonserver on 8003-8005) moved to free ones in the same pattern."""
    commands = re.findall(r"^\.venv/bin/triton-disagg (serve \w+ +-c examples/three_roles\.yaml)",
                          README, re.M)
    assert [c.split()[1] for c in commands] == ["context", "generation", "scheduler"]
    base = servers.free_port_run(6)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "three_roles.yaml").write_text(
        _three_roles_here(base, servers.free_ports(2)))
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "demo").symlink_to(demo_engine)
    prompts = [PROMPT, servers.PROMPTS[1]]
    with servers.serve("all", ["--engine", str(demo_engine)], tmp_path / "all") as served:
        reference = [servers.generate(served.http, {"text_input": p, "max_tokens": MAX_TOKENS})[1]
                     ["text_output"] for p in prompts]
    http, grpc = f"http://127.0.0.1:{base + 3}", f"127.0.0.1:{base + 4}"
    grpc_ports = {"context": base, "generation": base + 1, "scheduler": base + 4}  # work dirs
    with contextlib.ExitStack() as stack:
        for command in commands:
            role = command.split()[1]
            stack.enter_context(servers.serve_command(
                [sys.executable, "-m", "triton_disagg.cli", *command.split()],
                tmp_path / "work" / f"{role}-127.0.0.1-{grpc_ports[role]}", http, grpc,
                cwd=tmp_path))
        for prompt, text in zip(prompts, reference):
            status, body = servers.generate(http, {"text_input": prompt, "max_tokens": MAX_TOKENS})
            assert status == 200 and body["text_output"] == text, body
        deltas = servers.grpc_stream(grpc, prompts[1], MAX_TOKENS)
        assert "".join(deltas) == reference[1]
        # the guide's verification request, on the scheduler's HTTP front (its url's port)
        reply = requests.post(f"http://127.0.0.1:{base + 2}/v1/inference", timeout=60, json={
            "prompt": PROMPT, "model": demo_engine.name, "max_tokens": MAX_TOKENS})
        assert reply.status_code == 200 and reply.json()["text"] == reference[0], reply.text


def test_example_config_loads_as_written(demo_engine, tmp_path):
    """The root disagg_config.yaml, beside an engines/demo like the one `make demo` builds."""
    from triton_disagg.config.disagg import load_config

    config_path = tmp_path / "disagg_config.yaml"
    config_path.write_text((ROOT / "disagg_config.yaml").read_text())
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "demo").symlink_to(demo_engine)
    config = load_config(config_path)
    assert config.engine == demo_engine.resolve()  # relative to the config file, resolved
    assert config.context.cpus != config.generation.cpus
