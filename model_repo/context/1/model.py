"""context: prefill of a batch of prompts; first token + context_phase_params
(logic: triton_disagg.context.prefill). A ``release_kv`` request gives back the KV of
the ``context_phase_params`` it carries (a client left before generation took it) and
answers with no tokens. Only the deployment's orchestrators are answered
(:mod:`triton_disagg.peers`): any other request is refused before its tensors are read."""

import faulthandler
import json
import uuid

import numpy as np

import triton_python_backend_utils as pb_utils

from triton_disagg.log_format import configure_stub
from triton_disagg.triton.stub_start import watched_initialize

from triton_disagg import peers, protocol as P
from triton_disagg.triton import engine_request
from triton_disagg.context.prefill import ContextSide
from triton_disagg.engine.capacity import make_engine
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
        self.credential = peers.credential()
        instance = args["model_instance_name"]
        self.metrics = Metrics(pb_utils, "context", instance)
        readers.report_to(self.metrics)        # dropped frames: disagg_dropped_frames_total
        with self.metrics.closed_on_error():
            engine = make_engine(settings, "context", gpu_index(args))
            self.spec = engine.spec
            self.side = ContextSide(engine, settings, instance, self.metrics)

    def execute(self, requests):
        responses = [None] * len(requests)
        batch, slots, listeners = [], [], []
        for i, request in enumerate(requests):
            try:
                peers.check(request.parameters(), "context", self.credential)
                request_type = json.loads(request.parameters() or "{}").get(
                    P.REQUEST_TYPE, P.CONTEXT_ONLY)
                if request_type not in (P.CONTEXT_ONLY, P.RELEASE_KV):
                    raise RequestError(f"request_type {request_type!r}: the context model serves "
                                       f"{P.CONTEXT_ONLY!r} and {P.RELEASE_KV!r}")
                inputs = read_inputs(pb_utils, request, P.CONTEXT_INPUTS)
                if request_type == P.RELEASE_KV:
                    handle = inputs.get(P.CONTEXT_PHASE_PARAMS, np.zeros(0, np.uint8))
                    self.side.release(handle.tobytes())
                    responses[i] = self._response(engine_request.outputs([], [], 0.0, ""))
                    continue
                request_id = request.request_id() or uuid.uuid4().hex
                batch.append((request_id, engine_request.from_inputs(inputs, self.spec)))
                listener = inputs.get(P.KV_LISTENER)
                listeners.append(listener.tobytes() if listener is not None else b"")
                slots.append(i)
            except RequestError as exc:
                responses[i] = error_response(pb_utils, str(exc), exc.status)
        for i, result in zip(slots, self.side.prefill(batch, listeners) if batch else []):
            if isinstance(result, Exception):
                responses[i] = error_response(pb_utils, str(result),
                                              getattr(result, "status", "INTERNAL"))
            else:
                responses[i] = self._response(result)
        return responses

    @staticmethod
    def _response(outputs):
        outputs.setdefault(P.CONTEXT_PHASE_PARAMS, np.zeros(0, np.uint8))
        tensors = make_tensors(pb_utils, P.CONTEXT_OUTPUTS, outputs)
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.side.close()
        self.metrics.close()
