"""postprocessing: token ids -> text delta, multi-byte characters held back until complete
(logic: triton_disagg.serving.detokenize)."""

import faulthandler
import triton_python_backend_utils as pb_utils

from triton_disagg import protocol as P
from triton_disagg.engine.tokenizer import Tokenizer
from triton_disagg.serving.detokenize import text_delta
from triton_disagg.serving.placement import read_settings
from triton_disagg.serving.tensors import RequestError, error_response, make_tensors, read_inputs

faulthandler.enable()  # a crash in this stub logs every thread's traceback to the server log


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = Tokenizer(read_settings(args)["engine"])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = read_inputs(pb_utils, request, P.POSTPROCESS_INPUTS)
            except RequestError as exc:
                responses.append(error_response(pb_utils, str(exc)))
                continue
            text = text_delta(self.tokenizer.decode, inputs["output_ids"].tolist(),
                              int(inputs["output_offset"][0]), bool(inputs["is_final"][0]))
            tensors = make_tensors(pb_utils, P.POSTPROCESS_OUTPUTS, {"text_output": [text]})
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
