"""Every role's ``/healthz`` (triton_disagg/front/health.py): what :class:`ServerReadiness`
says for each answer of tritonserver, and the health-only front's app (context and
generation servers) answering 200 / 503 with the reason, nothing else; the real process
beside real servers: tests/server/test_scheduler_ready.py."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from triton_disagg.front.health import ASK_TIMEOUT_SECONDS, CLOSED, ServerReadiness
from triton_disagg.front.http_front import make_health_app


class FakeTriton:
    """A ``tritonclient.grpc.aio`` client's two readiness calls: ``server`` (bool, or an
    exception to raise) and the models that are ready; records each call's timeout."""

    def __init__(self, server, ready_models=()):
        self.server, self.ready_models, self.timeouts = server, set(ready_models), []

    async def is_server_ready(self, client_timeout=None):
        self.timeouts.append(client_timeout)
        if isinstance(self.server, Exception):
            raise self.server
        return self.server

    async def is_model_ready(self, model, client_timeout=None):
        self.timeouts.append(client_timeout)
        return model in self.ready_models


@pytest.mark.parametrize("triton, words", [
    (FakeTriton(True, {"context"}), None),
    (FakeTriton(False, {"context"}), "tritonserver is not ready"),
    (FakeTriton(False, {}), "the context model is not ready"),
    (FakeTriton(TimeoutError("deadline")), "tritonserver does not answer (TimeoutError)"),
])
def test_server_readiness_names_what_is_not_ready(triton, words):
    reason = asyncio.run(ServerReadiness(triton, ("context",)).ready())
    assert reason == words if words is None else words in reason
    assert triton.timeouts and set(triton.timeouts) == {ASK_TIMEOUT_SECONDS}   # never hangs


@pytest.mark.parametrize("gate_text, ready", [(None, False), ("no context server", False),
                                              ("", True)])
def test_a_schedulers_readiness_follows_its_roles_gate_file(tmp_path, gate_text, ready):
    gate = tmp_path / "roles_gate"
    if gate_text is not None:
        gate.write_text(gate_text)
    reason = asyncio.run(ServerReadiness(FakeTriton(True, {"context"}), ("context",),
                                         gate).ready())
    assert reason == (None if ready else CLOSED)
    assert "no context server" not in CLOSED       # a peer's name or address is not public


def test_the_health_only_app_answers_healthz_and_health_only():
    class Scripted:
        reason: str | None = "the generation model is not ready"

        async def ready(self):
            return self.reason

    readiness = Scripted()

    async def main():
        async with TestClient(TestServer(make_health_app(readiness))) as client:
            for path in ("/healthz", "/health"):
                resp = await client.get(path)
                assert resp.status == 503
                assert await resp.json() == {"status": "unavailable",
                                             "reason": "the generation model is not ready"}
            readiness.reason = None
            resp = await client.get("/healthz")
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
            for resp in (await client.post("/v1/completions", json={}),
                         await client.get("/v1/models")):
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "invalid_request_error"
    asyncio.run(main())


def test_probes_at_once_share_one_question_to_tritonserver():
    """``/healthz`` is public and ungated: probes that arrive together share one check, so a
    flood of them costs tritonserver one round of questions at a time, not one per probe
    (issue 27 re-review), and a probe that leaves does not cancel the others' check."""
    class Slow(FakeTriton):
        async def is_server_ready(self, client_timeout=None):
            await asyncio.sleep(0.05)
            return await super().is_server_ready(client_timeout)

    triton = Slow(True, {"context"})

    async def main():
        readiness = ServerReadiness(triton, ("context",))
        leaver = asyncio.ensure_future(readiness.ready())
        await asyncio.sleep(0)
        leaver.cancel()
        answers = await asyncio.gather(*[readiness.ready() for _ in range(50)])
        assert answers == [None] * 50
        assert await readiness.ready() is None          # a later probe asks afresh
    asyncio.run(main())
    assert len(triton.timeouts) == 2 * 2                 # two rounds: server + one model
