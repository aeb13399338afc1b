"""generation: decoupled decode with continuous batching (logic: triton_disagg.serving).

execute() only validates and hands each request to the instance's DecodeLoop;
the loop's thread runs the engine and sends every response. A request with
``stop`` true ends the live request whose Triton request id it carries.
"""

import faulthandler
import json
import uuid
from pathlib import Path

import triton_python_backend_utils as pb_utils

from triton_disagg import protocol as P
from triton_disagg.serving import engine_request
from triton_disagg.serving.decode_loop import DecodeLoop
from triton_disagg.serving.generation import GenerationSide
from triton_disagg.serving.kv_side import make_engine
from triton_disagg.serving.metrics import Metrics
from triton_disagg.serving.placement import cores_for, pin, read_settings
from triton_disagg.serving.stop_registry import StopRegistry
from triton_disagg.serving.tensors import RequestError, error_response, make_tensors, read_inputs

faulthandler.enable()  # a crash in this stub logs every thread's traceback to the server log

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        settings = read_settings(args)
        self.limits = pin(cores_for(settings, args))
        instance = args["model_instance_name"]
        engine = make_engine(settings, "generation")
        self.metrics = Metrics(pb_utils, "generation", instance)
        with self.metrics.closed_on_error():
            self.side = GenerationSide(engine, settings, instance, self.metrics)
            # Triton hands a stop to any instance: several instances share where they post them.
            several = len(settings["instance_cpus"]) > 1      # one entry per instance
            stops = StopRegistry(Path(args["model_repository"]) / "stops") if several else None
            self.loop = DecodeLoop(engine, self._emit, self.side,
                                   stream_interval=settings.get("stream_interval", 1), stops=stops)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = read_inputs(pb_utils, request, P.GENERATION_INPUTS)
                if bool(inputs.get(P.STOP, [False])[0]):
                    self.loop.stop(request.request_id())
                    sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
                    continue
                request_type = json.loads(request.parameters() or "{}").get(
                    P.REQUEST_TYPE, P.CONTEXT_AND_GENERATION)
                work = self.side.prepare(request_type, engine_request.parse(inputs), inputs)
            except RequestError as exc:
                sender.send(error_response(pb_utils, str(exc)), flags=FINAL)
                continue
            self.loop.submit(request.request_id() or uuid.uuid4().hex, work, sender,
                             sender.is_cancelled)
        return None

    def _emit(self, sender, outputs, final, error):
        if error is not None:
            response = error_response(pb_utils, error)
        else:
            response = pb_utils.InferenceResponse(
                output_tensors=make_tensors(pb_utils, P.GENERATION_OUTPUTS, outputs))
        sender.send(response, flags=FINAL if final else 0)

    def finalize(self):
        self.loop.close()
        self.side.close()
        self.metrics.close()
