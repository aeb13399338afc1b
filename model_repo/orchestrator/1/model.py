"""orchestrator: BLS model (logic: triton_disagg.front.orchestrator).

Each request runs as a task on the stub's event loop: context call, first token
out at once, KV handoff, generation request, then its tokens in over ZeroMQ (this
instance's token socket), detokenized here and sent to the client. Context and
generation are reached in-process (BLS, `serve all`) or over gRPC (`serve scheduler`:
each call routed over the role's pool, the config's urls or the servers in etcd; see
triton_disagg.routing.pools).

Each task answers through its request's response sender, in both transaction
policies: decoupled (streaming, the default) and not (``decoupled_mode: false``:
exactly one response per request, so the ensemble answers plain ``infer()``);
``execute`` waits for its tasks only in the first (see there why).
"""

import asyncio
import faulthandler
import logging
import uuid

import triton_python_backend_utils as pb_utils

from triton_disagg.log_format import Rejections, configure_stub
from triton_disagg.triton.stub_start import watched_initialize

from triton_disagg import protocol as P
from triton_disagg.config.roles import Role, instance_models
from triton_disagg.config.settings import from_model_config
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.front.tokenizer import Tokenizer
from triton_disagg import readers
from triton_disagg.triton.metrics import Metrics
from triton_disagg.errors import CODE_IN_MESSAGE, EngineError, ErrorCode, RequestError, \
    with_code
from triton_disagg.front.orchestrator import MAX_RELEASES, Orchestrator
from triton_disagg.front.engine_calls import BLSTransport, InFlightCap, OrchestratorGate, \
    public_message
from triton_disagg.routing.pools import start_pools
from triton_disagg.triton.tensors import asks, error_response, make_tensors, read_inputs, \
    scalar, seal_key
from triton_disagg.front.token_inbox import TokenInbox
from triton_disagg.front.grpc_transport import GrpcTransport

faulthandler.enable()  # a crash in this stub logs every thread's traceback to the server log

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    @watched_initialize
    def initialize(self, args):
        configure_stub(args["model_instance_name"])   # serve --log-format
        settings = from_model_config("orchestrator", args)
        self.metrics = Metrics(pb_utils, "orchestrator", args["model_instance_name"])
        readers.report_to(self.metrics)        # dropped frames: disagg_dropped_frames_total
        self.pools = None
        with self.metrics.closed_on_error():
            if settings.transport == "bls":
                self.transport = BLSTransport(
                    pb_utils, settings.max_concurrent_requests + MAX_RELEASES,
                    instance_models(Role.CONTEXT, settings.pools[Role.CONTEXT].instances))
            else:
                self.pools = start_pools(settings, self.metrics)
                self.transport = GrpcTransport(self.pools.routers, self.metrics,
                                               settings.grpc_tls)
            decode = Tokenizer(settings.engine).decode
        self.tokens = TokenInbox(settings.token_host, settings.stall_seconds)
        self.orchestrator = Orchestrator(self.transport, self.tokens, settings.mode, decode,
                                         self.metrics, settings.max_local_prefill_length,
                                         settings.overlap_kv_transfer)
        self.gate = OrchestratorGate(seal_key(), EngineSpec.load(settings.engine))
        self.cap = InFlightCap(settings.max_concurrent_requests)
        self.decoupled = settings.decoupled
        self.log = logging.getLogger("orchestrator")   # JSON lines with serve --log-format json
        self.rejections = Rejections(self.log)
        self.tasks: set[asyncio.Task] = set()   # requests in flight (held: the loop keeps weak refs)

    async def execute(self, requests):
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._serve(request)) for request in requests]
        for task in tasks:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        if self.decoupled:
            # The stub runs a decoupled execute in the background and logs "Cannot remove
            # future from background" when it returns before being registered there, so it
            # lasts as long as its requests. A non-decoupled execute is awaited by the stub
            # (one batch at a time), so it must not wait.
            await asyncio.gather(*tasks)
        return None

    async def _serve(self, request):
        sender = request.get_response_sender()

        async def send(outputs, final):
            if outputs is None:
                sender.send(flags=FINAL)
            else:
                tensors = make_tensors(pb_utils, P.ORCHESTRATOR_OUTPUTS, outputs)
                sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                            flags=FINAL if final else 0)

        try:
            with self.cap.slot():         # past the cap: ServerBusy, before any tensor is read
                inputs = read_inputs(pb_utils, request, P.ORCHESTRATOR_INPUTS)
                engine_request = self.gate.check(inputs)
                if scalar(inputs, "stream", False) and not self.decoupled:
                    raise RequestError("stream: true needs a decoupled ensemble; this server "
                                       "runs decoupled_mode: false (send stream: false, or "
                                       "serve with decoupled_mode: true)")
                await self.orchestrator.handle(inputs, engine_request, send,
                                               sender.is_cancelled, request.request_id())
        except (RequestError, EngineError) as exc:
            request_id = request.request_id() or uuid.uuid4().hex[:12]
            self.rejections.rejected(exc.status, f"request {request_id}: {exc}", request_id)
            sender.send(_error(request, public_message(exc, request_id), exc.status),
                        flags=FINAL)
        except Exception as exc:  # noqa: BLE001 - never leave a request without its final response
            request_id = request.request_id() or uuid.uuid4().hex[:12]
            self.log.exception("orchestrator: request %s: %s: %s", request_id,
                               type(exc).__name__, exc)
            sender.send(_error(request, public_message(exc, request_id), ErrorCode.INTERNAL),
                        flags=FINAL)

    def finalize(self):
        try:
            self.tokens.close()
            if self.pools is not None:
                self.pools.close()
        finally:
            self.metrics.close()


def _error(request: "pb_utils.InferenceRequest", message: str,
           code: ErrorCode) -> "pb_utils.InferenceResponse":
    """The error response to ``request``: its code in the message too when the caller asked
    (:data:`~triton_disagg.errors.CODE_IN_MESSAGE`: the HTTP front, whose stream error
    carries no status, see :mod:`triton_disagg.front.orchestrator_call`)."""
    return error_response(pb_utils, with_code(code, message)
                          if asks(request, CODE_IN_MESSAGE) else message, code)
