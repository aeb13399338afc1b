"""Helpers for tests that start a real tritonserver (import as ``import servers``).

:func:`serve` runs ``triton-disagg serve ROLE ...`` exactly as a user would,
in its own process group, waits for its "ready" line, yields a
:class:`Served` with the URLs, and on exit sends SIGTERM (the CLI stops
tritonserver and its stubs) and checks that the whole group is gone.

Clients: :func:`generate` (HTTP ``/generate``), :func:`generate_stream` (HTTP
SSE ``/generate_stream``), :func:`grpc_stream` (tritonclient gRPC streaming),
:func:`metrics` (the metrics endpoint as text). Reference: :func:`offline_text`
(the engine run in-process, as `triton-disagg run` does).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from triton_disagg.clients.stream import array_inputs
from triton_disagg.launch.deploy import free_port_run, free_ports  # noqa: F401 - tests use both
from triton_disagg.launch.process_group import terminate
from waiting import wait_until        # the server tests import it from here too

READY_TIMEOUT = 240.0
READY_POLL = 0.3               # seconds between looks for a serve command's ready line
PROMPTS = ["The quick brown fox", "日本語と中文的文字", "emoji 🎉🚀 party", "a"]


def cli_argv(argv: list[str]) -> list[str]:
    """A ``triton-disagg ...`` command line run by this interpreter (``python -m
    triton_disagg.cli ...``), as the console script would run it."""
    assert argv[0] == "triton-disagg", argv
    return [sys.executable, "-m", "triton_disagg.cli", *argv[1:]]


@dataclass
class Served:
    process: subprocess.Popen
    http: str | None            # http://127.0.0.1:PORT
    grpc: str                   # 127.0.0.1:PORT
    metrics: str | None
    log: Path                   # the CLI's stdout/stderr
    work_dir: Path
    front: str | None = None    # http://127.0.0.1:PORT of the HTTP front (OpenAI API or /healthz)

    def server_log(self) -> str:
        path = self.work_dir / "tritonserver.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def why(self, request_id: str, tail: int = 40) -> str:
        """What the logs say of ``request_id`` (a front answered it a 5xx): the lines of
        every log under the work dir (the CLI's output, the HTTP front's, tritonserver's)
        that carry it, then the last ``tail`` lines of tritonserver's log (a crash, or a
        fault logged without the id)."""
        logs = sorted({self.log, *self.work_dir.glob("*.log")})
        lines = [line for path in logs for line in path.read_text(errors="replace").splitlines()]
        server = self.server_log().splitlines()
        carrying = [line for line in lines if request_id and request_id in line]
        return "\n".join([f"--- log lines of request {request_id} ---", *carrying,
                          "--- tritonserver.log tail ---", *server[-tail:]])


@contextlib.contextmanager
def serve(role: str, args: list[str], work_dir: Path, http: bool = True, metrics: bool = True,
          grpc_port: int | None = None, until: str = "ready (", env: dict[str, str] | None = None):
    """Run ``triton-disagg serve role *args`` on free ports (gRPC: ``grpc_port`` when given)
    until the block exits; the block starts once its output shows ``until``. Every role's
    HTTP front (``serve all|scheduler``: the OpenAI API; context and generation: ``/healthz``)
    gets a free port too. ``env``: its environment (default: ours)."""
    http_port, free_grpc, metrics_port, front_port = free_ports(4)
    grpc_port = grpc_port or free_grpc
    cmd = [sys.executable, "-m", "triton_disagg.cli", "serve", role, *args,
           "--grpc-port", str(grpc_port), "--work-dir", str(work_dir),
           "--front-port", str(front_port)]
    if http:
        cmd += ["--http-port", str(http_port)]
    if metrics:
        cmd += ["--metrics-port", str(metrics_port)]
    with serve_command(cmd, work_dir, f"http://127.0.0.1:{http_port}" if http else None,
                       f"127.0.0.1:{grpc_port}",
                       f"http://127.0.0.1:{metrics_port}" if metrics else None,
                       until=until, env=env) as served:
        served.front = f"http://127.0.0.1:{front_port}"
        yield served


@contextlib.contextmanager
def serve_config(config_text: str, work_dir: Path):
    """`serve all -c` a disagg_config.yaml written from ``config_text`` into ``work_dir``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config = work_dir / "disagg_config.yaml"
    config.write_text(config_text)
    with serve("all", ["-c", str(config)], work_dir / "run") as served:
        yield served


@contextlib.contextmanager
def serve_command(cmd: list[str], work_dir: Path, http: str | None, grpc: str,
                  metrics: str | None = None, cwd: Path | None = None, until: str = "ready (",
                  env: dict[str, str] | None = None):
    """Run a `serve` command line as given (it serves at the URLs given here and writes
    under ``work_dir``) until the block exits; ``env``: its environment (default: ours)."""
    with serve_commands([(cmd, work_dir, http, grpc, metrics)], cwd, until, env) as (served,):
        yield served


@contextlib.contextmanager
def serve_commands(commands: list[tuple], cwd: Path | None = None, until: str = "ready (",
                   env: dict[str, str] | None = None):
    """Start several `serve` command lines at once, each ``(cmd, work_dir, http, grpc,
    metrics)`` as :func:`serve_command` takes them, so their servers load side by side;
    yields their :class:`Served` once every one's output shows ``until`` (a scheduler's
    "ready (" waits for its peers; "up (" does not), and stops them all on exit."""
    started: list[Served] = []
    try:
        for cmd, work_dir, http, grpc, metrics in commands:
            work_dir.mkdir(parents=True, exist_ok=True)
            log = work_dir / "serve-cli.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=cwd, env=env)
            started.append(Served(proc, http, grpc, metrics, log, work_dir))
        for served in started:
            _wait_for_line(served, until)
        yield started
    finally:
        failures = []
        for served in started:           # every one stopped, even after one fails to
            try:
                stop(served)
            except AssertionError as exc:
                failures.append(exc)
        if failures:
            raise failures[0]


def stop(served: Served, timeout: float = 60.0) -> int:
    """SIGTERM the CLI; assert that it, tritonserver and every stub are gone."""
    if not terminate(served.process, timeout):
        raise AssertionError(f"serve did not stop on SIGTERM:\n{served.log.read_text()}")
    left = processes_under(served.work_dir)
    assert not left, f"left running after serve stopped: {left}"
    return served.process.returncode


def tritonserver_pid(work_dir: Path) -> int:
    """The pid (and process group) of the tritonserver a `serve` command started under
    ``work_dir``."""
    for line in processes_under(work_dir):
        pid, cmd = line.split(": ", 1)
        if cmd.split()[0].endswith("/tritonserver"):
            return int(pid)
    raise AssertionError(f"no tritonserver under {work_dir}")


def argv(pid: int) -> list[str]:
    """Process ``pid``'s command line, as every local user reads it (``/proc`` is 0444)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def tritonserver_flag(work_dir: Path, name: str) -> str:
    """The value of ``--name=...`` on the command line of the tritonserver under ``work_dir``."""
    return next(a.split("=", 1)[1] for a in argv(tritonserver_pid(work_dir))
                if a.startswith(f"--{name}="))


def processes_under(work_dir: Path) -> list[str]:
    """Command lines of live processes that mention ``work_dir`` (tritonserver, its stubs)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(l for l in (entry / "status").read_text().splitlines() if l.startswith("State"))
        except (OSError, StopIteration):
            continue
        if str(work_dir.resolve()) in cmd and "zombie" not in state:
            found.append(f"{entry.name}: {cmd[:120]}")
    return found


def _wait_for_line(served: Served, marker: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        text = served.log.read_text(errors="replace")
        if marker in text:
            return
        if served.process.poll() is not None:
            raise AssertionError(f"serve exited with {served.process.returncode}:\n{text}\n"
                                 f"--- tritonserver.log ---\n{served.server_log()[-6000:]}")
        time.sleep(READY_POLL)
    raise AssertionError(f"serve not ready in {READY_TIMEOUT}s:\n{served.log.read_text()}")


def post_json(url: str, payload: dict, timeout: float = 120.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def generate(http: str, payload: dict, model: str = "ensemble") -> tuple[int, dict]:
    return post_json(f"{http}/v2/models/{model}/generate", payload)


def generate_stream(http: str, payload: dict, model: str = "ensemble",
                    timeout: float = 120.0) -> list[dict]:
    """Every SSE event of ``/generate_stream`` as a dict (errors come as {"error": ...})."""
    request = urllib.request.Request(f"{http}/v2/models/{model}/generate_stream",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    return events


def grpc_stream(grpc: str, text: str, max_tokens: int, stream: bool = True,
                model: str = "ensemble", extra: dict | None = None, timeout: float = 120.0,
                arrived=None) -> list:
    """Send one request over a gRPC stream; returns the text_output strings (or raises).
    ``arrived(n)``, if given, is called with the count of pieces so far as each one comes."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs = {"text_input": np.array([[text.encode()]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32),
              "stream": np.array([[stream]], dtype=bool), **(extra or {})}
    inputs = {name: arr for name, arr in inputs.items() if arr is not None}   # None: left out
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, array_inputs(inputs), enable_empty_final_response=True)
        texts = []
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                client.stop_stream()
                raise RuntimeError(error.message())
            response = result.get_response()
            out = result.as_numpy("text_output")
            if out is not None:
                texts.append(out.reshape(-1)[0].decode("utf-8"))
                if arrived is not None:
                    arrived(len(texts))
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return texts


def offline_text(engine_dir: Path, kv_layout=None):
    """``(prompt, max_tokens[, add_special_tokens]) -> text`` as `triton-disagg run` prints it
    (greedy, stops at eos; the prompt with the tokenizer's BOS unless ``add_special_tokens``
    is False, as a chat's text), with the engine's KV layout or ``kv_layout`` (a :class:`KVLayout`), computed without the
    prefix cache: a server (cache on by default) must give the uncached run's text."""
    from triton_disagg.engine.llm_engine import LLMEngine
    from triton_disagg.engine.sampling import SamplingParams
    from triton_disagg.engine.spec import EngineSpec
    from triton_disagg.front.tokenizer import Tokenizer

    spec = EngineSpec.load(engine_dir)
    tokenizer = Tokenizer(engine_dir)
    engine = LLMEngine(engine_dir, num_blocks=512, kv_layout=kv_layout, prefix_caching=False)

    def run(prompt: str, max_tokens: int, add_special_tokens: bool = True) -> str:
        params = SamplingParams(max_tokens=max_tokens, end_id=spec.eos_token_id)
        (seq,) = engine.generate([tokenizer.encode(prompt, add_special_tokens)], params)
        return tokenizer.decode(seq.output_ids)
    return run


def metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return resp.read().decode()


def orchestrator_inputs(ids, max_tokens, sealed=True):
    """tritonclient gRPC inputs for the orchestrator model: :func:`orchestrator_arrays`."""
    return array_inputs(orchestrator_arrays(ids, max_tokens, sealed))


def orchestrator_arrays(ids, max_tokens, sealed=True):
    """The orchestrator model's input arrays (batch of one): a streaming greedy request, no
    end id, sealed as preprocessing seals it (this test process holds the deployment secret)
    unless not ``sealed``."""
    import numpy as np

    from triton_disagg import protocol as P
    from triton_disagg.triton import tensors

    arrays = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[max_tokens]], np.int32),
              "stop_words_list": np.array([[[0], [-1]]], np.int32),
              "bad_words_list": np.array([[[0], [-1]]], np.int32),
              "end_id": np.array([[-1]], np.int32), "pad_id": np.array([[2]], np.int32),
              "stream": np.array([[True]])}
    if sealed:
        unbatched = {name: array[0] for name, array in arrays.items()}   # [1, ...] -> [...]
        arrays[P.PREPROCESSED] = tensors.seal(unbatched, tensors.seal_key())[None]   # [1, 32]
    return arrays


def stream_then_cancel(grpc: str, max_tokens: int = 1500) -> None:
    """Stream a long request straight to the orchestrator (Triton 2.51 does not pass an
    ensemble cancel on), take three responses, then cancel it from the client."""
    import queue

    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("orchestrator", orchestrator_inputs([5, 6, 7], max_tokens))
        for _ in range(3):
            result, error = got.get(timeout=60)
            assert error is None, error
        client.stop_stream(cancel_requests=True)


def cancel_a_stream(grpc: str, metrics_url: str, attempts: int = 3) -> None:
    """:func:`stream_then_cancel` until the orchestrator counts a request ``cancelled``: one
    that it counts ``finished`` instead ran to its end (the demo engine's 256 positions)
    before the stop reached the server, under load, and is tried again (``attempts`` in all)."""
    from triton_disagg.routing.scrape import scrape, total

    def outcomes() -> dict[str, float]:
        samples = scrape(metrics_url)
        return {o: total(samples, "disagg_requests_total", role="orchestrator", outcome=o)
                for o in ("cancelled", "finished")}

    for _ in range(attempts):
        before = outcomes()
        stream_then_cancel(grpc)
        wait_until(lambda: outcomes() != before, 30, "the orchestrator counts the request")
        if outcomes()["cancelled"] > before["cancelled"]:
            return
    raise AssertionError(f"each of {attempts} streams finished before its cancel: {outcomes()}")
