"""preprocessing: text -> input_ids, words -> id lists, default end/pad ids
(logic: triton_disagg.front.tokenizer). Stamps each request's arrival (``arrival_ns``),
where the orchestrator's time to first token starts."""

import faulthandler
import logging
import time

import triton_python_backend_utils as pb_utils

from triton_disagg.log_format import Rejections, configure_stub
from triton_disagg.triton.stub_start import watched_initialize

from triton_disagg import protocol as P
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.front.tokenizer import Preprocessor, Tokenizer
from triton_disagg.config.settings import from_model_config
from triton_disagg.errors import RequestError
from triton_disagg.triton.tensors import error_response, make_tensors, read_inputs, seal_key

faulthandler.enable()  # a crash in this stub logs every thread's traceback to the server log


class TritonPythonModel:
    @watched_initialize
    def initialize(self, args):
        configure_stub(args["model_instance_name"])   # serve --log-format
        engine = from_model_config("preprocessing", args).engine
        spec = EngineSpec.load(engine)
        self.pre = Preprocessor(Tokenizer(engine), spec.max_seq_len, spec.eos_token_id,
                                spec.pad_token_id, seal_key())
        self.rejections = Rejections(logging.getLogger("preprocessing"))

    def execute(self, requests):
        arrival = time.monotonic_ns()
        responses = []
        for request in requests:
            try:
                outputs = self.pre.process(read_inputs(pb_utils, request, P.PREPROCESS_INPUTS))
            except RequestError as exc:
                self.rejections.rejected(exc.status, str(exc), request.request_id() or None)
                responses.append(error_response(pb_utils, str(exc), exc.status))
                continue
            outputs[P.ARRIVAL] = [arrival]
            tensors = make_tensors(pb_utils, P.PREPROCESS_OUTPUTS, outputs)
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
