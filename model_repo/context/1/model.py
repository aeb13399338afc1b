"""context: prefill; first token + context_phase_params (logic: triton_disagg.context:
prefill_loop.py).

execute() only validates and hands each request to the instance's PrefillLoop, and
returns None: the loop's thread answers the request through its response sender (one
response with the final flag: the model keeps Triton's default transaction policy, so the
orchestrator's BLS and gRPC calls are plain unary calls) once its prefill is done; a
request waits in the loop's queue while the pool is full, up to its timeout. A
``release_kv`` request gives back the KV of the ``context_phase_params`` it carries (a
client left before generation took it) and is answered at once with no tokens. Only the
deployment's orchestrators are answered
(:func:`~triton_disagg.triton.tensors.check_peer`): any other request is refused before its
tensors are read."""

import faulthandler
import json
import uuid

import numpy as np

import triton_python_backend_utils as pb_utils

from triton_disagg.log_format import configure_stub
from triton_disagg.triton.stub_start import watched_initialize

from triton_disagg import protocol as P
from triton_disagg.triton import tensors
from triton_disagg.context.prefill_loop import PrefillLoop, Prompt, deadline_after
from triton_disagg.engine.capacity import make_engine
from triton_disagg.routing.kv_events import kv_events_of
from triton_disagg import readers
from triton_disagg.triton.metrics import Metrics
from triton_disagg.config.settings import from_model_config
from triton_disagg.triton.placement import cores_for, gpu_index, pin
from triton_disagg.errors import RequestError
from triton_disagg.triton.tensors import error_response, make_tensors, read_inputs

faulthandler.enable()  # a crash in this stub logs every thread's traceback to the server log


class TritonPythonModel:
    @watched_initialize
    def initialize(self, args):
        configure_stub(args["model_instance_name"])   # serve --log-format
        settings = from_model_config("context", args)
        self.limits = pin(cores_for(settings.instance_cpus, args))
        self.credential = tensors.peer_credential()
        instance = args["model_instance_name"]
        self.metrics = Metrics(pb_utils, "context", instance)
        readers.report_to(self.metrics)        # dropped frames: disagg_dropped_frames_total
        with self.metrics.closed_on_error():
            self.kv_events = kv_events_of(settings, args)
            engine = make_engine(settings, "context", gpu_index(args), self.kv_events)
            self.spec = engine.spec
            self.loop = PrefillLoop(engine, settings, instance, self.metrics)

    def execute(self, requests):
        prompts = []
        for request in requests:
            answer = _Answer(request.get_response_sender())
            try:
                tensors.check_peer(request.parameters(), "context", self.credential)
                request_type = json.loads(request.parameters() or "{}").get(
                    P.REQUEST_TYPE, P.CONTEXT_ONLY)
                if request_type not in (P.CONTEXT_ONLY, P.RELEASE_KV):
                    raise RequestError(f"request_type {request_type!r}: the context model serves "
                                       f"{P.CONTEXT_ONLY!r} and {P.RELEASE_KV!r}")
                inputs = read_inputs(pb_utils, request, P.CONTEXT_INPUTS)
                if request_type == P.RELEASE_KV:
                    handle = inputs.get(P.CONTEXT_PHASE_PARAMS, np.zeros(0, np.uint8))
                    self.loop.release(handle.tobytes())
                    answer.send(tensors.outputs([], [], 0.0, ""))
                    continue
                listener = inputs.get(P.KV_LISTENER)
                prompts.append(Prompt(request.request_id() or uuid.uuid4().hex,
                                      tensors.from_inputs(inputs, self.spec), answer,
                                      deadline_after(request.timeout() / 1e6),
                                      listener.tobytes() if listener is not None else b""))
            except RequestError as exc:
                answer.send(exc)
        self.loop.submit(prompts)          # the batch queues together: one prefill pass
        return None

    def finalize(self):
        self.loop.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.metrics.close()


class _Answer:
    """One request's answer through its response sender (the loop's
    :class:`~triton_disagg.context.prefill_loop.Answer`): outputs or an error, sent once
    with the final flag. The request itself is not kept past ``execute``: its sender is."""

    def __init__(self, sender):
        self.sender = sender

    def send(self, result):
        if isinstance(result, Exception):
            response = error_response(pb_utils, str(result), getattr(result, "status", "INTERNAL"))
        else:
            result.setdefault(P.CONTEXT_PHASE_PARAMS, np.zeros(0, np.uint8))
            response = pb_utils.InferenceResponse(
                output_tensors=make_tensors(pb_utils, P.CONTEXT_OUTPUTS, result))
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def cancelled(self):
        return self.sender.is_cancelled()
