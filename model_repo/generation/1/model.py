"""generation: decode with continuous batching; tokens leave over ZeroMQ
(logic: triton_disagg.generation: decode_loop.py).

execute() only validates and hands each request to the instance's DecodeLoop, then
answers it at once with one response: the instance's control address (where stops for
that request go; empty: a ``context_and_generation_if_cached`` request declined), or an
error. The loop's thread runs the engine and sends the tokens
to the orchestrator address the request names (request parameter ``token_address``).
Only the deployment's orchestrators are answered
(:func:`~triton_disagg.triton.tensors.check_peer`): any other request is refused before its
tensors are read.
"""

import faulthandler

import numpy as np
import triton_python_backend_utils as pb_utils
import zmq

from triton_disagg.log_format import configure_stub
from triton_disagg.triton.stub_start import watched_initialize

from triton_disagg import protocol as P
from triton_disagg.triton import tensors
from triton_disagg.generation.decode_loop import (DecodeAdmission, DecodeLoop,
                                                  read_request_parameters)
from triton_disagg.token_wire import StopInbox, TokenOutbox
from triton_disagg.engine.capacity import make_engine
from triton_disagg.routing.kv_events import kv_events_of
from triton_disagg.kv.connector_factory import connector_for
from triton_disagg import readers
from triton_disagg.triton.metrics import Metrics
from triton_disagg.config.settings import from_model_config
from triton_disagg.triton.placement import cores_for, gpu_index, pin
from triton_disagg.errors import RequestError, Unavailable
from triton_disagg.triton.tensors import error_response, make_tensors, read_inputs

faulthandler.enable()  # a crash in this stub logs every thread's traceback to the server log


class TritonPythonModel:
    @watched_initialize
    def initialize(self, args):
        configure_stub(args["model_instance_name"])   # serve --log-format
        settings = from_model_config("generation", args)
        self.limits = pin(cores_for(settings.instance_cpus, args))
        self.credential = tensors.peer_credential()
        instance = args["model_instance_name"]
        self.kv_events = kv_events_of(settings, args)
        engine = make_engine(settings, "generation", gpu_index(args), self.kv_events)
        self.spec = engine.spec
        self.metrics = Metrics(pb_utils, "generation", instance)
        readers.report_to(self.metrics)        # dropped frames: disagg_dropped_frames_total
        with self.metrics.closed_on_error():
            connector = (connector_for(settings, engine, instance)
                         if not settings.aggregated else None)
            self.admission = DecodeAdmission(engine, connector, self.metrics,
                                              settings.max_local_prefill_length)
            context = zmq.Context.instance()
            stops = StopInbox(context, settings.token_host, settings.token_bind)
            self.control_address = stops.address
            self.loop = DecodeLoop(engine, TokenOutbox(context), self.admission,
                                   stream_interval=settings.stream_interval,
                                   stops=stops, stuck_seconds=settings.stall_seconds)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors.check_peer(request.parameters(), "generation", self.credential)
                request_type, address = read_request_parameters(request.parameters())
                request_id = request.request_id()
                if not request_id:
                    raise RequestError("generation needs the orchestrator's request id as the "
                                       "Triton request id (the stream's events carry it)")
                inputs = read_inputs(pb_utils, request, P.GENERATION_INPUTS)
                request = tensors.from_inputs(inputs, self.spec)
                declined = self.admission.declines(request_type, request)
                kv = None if declined else self.admission.prompt_kv(request_type, request,
                                                                     inputs)
            except (RequestError, Unavailable) as exc:
                responses.append(error_response(pb_utils, str(exc), exc.status))
                continue
            if declined:                   # its prompt is not cached here
                answer = {P.CONTROL_ADDRESS: [""], P.KV_LISTENER: np.zeros(0, np.uint8)}
            else:
                self.loop.submit(request_id, request, address, kv)
                answer = {P.CONTROL_ADDRESS: [self.control_address],
                          P.KV_LISTENER: np.frombuffer(kv.listener if kv else b"", np.uint8)}
            ack = make_tensors(pb_utils, P.GENERATION_OUTPUTS, answer)
            responses.append(pb_utils.InferenceResponse(output_tensors=ack))
        return responses

    def finalize(self):
        self.loop.close()
        self.admission.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.metrics.close()
