"""peers_ready: the scheduler's readiness gate (logic: launch/peers_gate.py).

It loads (READY) when its config parameter ``closed`` is empty, and fails to load with that
reason otherwise: Triton then reports the server not ready. Every request gets an error.
"""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        reason = parameters.get("closed", {}).get("string_value", "")
        if reason:
            raise RuntimeError(f"not ready: {reason}")

    def execute(self, requests):
        error = pb_utils.TritonError("peers_ready only gates the scheduler's readiness; send "
                                     "requests to the ensemble")
        return [pb_utils.InferenceResponse(error=error) for _ in requests]
