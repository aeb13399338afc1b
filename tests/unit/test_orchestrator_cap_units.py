"""One orchestrator instance takes at most ``scheduler_server.max_concurrent_requests``
requests at once (:class:`InFlightCap`): one more is refused at once with UNAVAILABLE and
words the HTTP front maps to 503, a slot comes back however its request ends, and the
config refuses a cap that is not a whole number >= 1."""

from __future__ import annotations

import pytest

from triton_disagg.config.disagg import load_config
from triton_disagg.errors import ServerBusy, UserError
from triton_disagg.front.engine_calls import InFlightCap, public_message
from triton_disagg.triton.render import settings


def test_one_past_the_cap_is_refused_at_once_and_a_slot_comes_back_on_error():
    cap = InFlightCap(2)
    with cap.slot(), cap.slot():
        with pytest.raises(ServerBusy, match="max_concurrent_requests"):
            with cap.slot():
                pass
    with pytest.raises(RuntimeError):
        with cap.slot():
            raise RuntimeError("the request failed")
    assert cap.in_flight == 0
    with cap.slot():
        assert cap.in_flight == 1


def test_the_client_is_told_busy_and_unavailable():
    exc = ServerBusy("2 requests in flight")
    assert exc.status == "UNAVAILABLE"
    message = public_message(exc, "r1")
    assert "busy" in message and "retry later" in message and "2 requests" not in message


def test_the_config_sets_the_cap_per_orchestrator_instance(tmp_path, demo_engine):
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{engine: {demo_engine}}}\n"
                    "scheduler_server: {max_concurrent_requests: 3}\n")
    config = load_config(path)
    assert settings("orchestrator", "all", config).max_concurrent_requests == 3
    path.write_text(f"model: {{engine: {demo_engine}}}\n"
                    "scheduler_server: {max_concurrent_requests: 0}\n")
    with pytest.raises(UserError, match="scheduler_server.max_concurrent_requests"):
        load_config(path)
