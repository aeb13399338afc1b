"""Every tensor name, dtype and shape that crosses a Triton model boundary, and every
request parameter and request type: the models' contract.

Models import their names from here and :mod:`triton_disagg.triton.render` writes the
``input``/``output`` sections of every ``config.pbtxt`` from these tables, so a
name cannot drift between a config and the code reading it.

Shapes exclude the batch dimension: every model is rendered with the same
``max_batch_size`` (Triton refuses an ensemble whose value exceeds a step's),
so each tensor a model sees has a leading batch axis; the orchestrator,
context and generation models serve one sequence per request (batch 1) and
batch across requests themselves.

- Public: :data:`ENSEMBLE_INPUTS` / :data:`ENSEMBLE_OUTPUTS` carry
  TensorRT-LLM's ``ensemble`` names, dtypes and shapes, so existing
  tritonclient code works unchanged.
- Orchestrator <-> context/generation (:data:`ENGINE_INPUTS` and friends)
  follow TensorRT-LLM's ``tensorrt_llm`` model, so a GPU deployment can swap
  the engine under the same orchestrator. The request parameter
  ``request_type`` picks the phase. A ``generation_only`` request carries the
  context response's ``context_phase_params`` unchanged and ``input_ids`` =
  the prompt plus the first token the context model returned. With
  ``--overlap_kv_transfer`` generation is asked first instead
  (``generation_awaiting_context``, ``input_ids`` = the prompt): it answers with a
  ``kv_listener`` and, once it holds the request's blocks, sends an event with no tokens on
  the token stream; the context, then given the listener, announces the KV to generation
  as it prefills (:mod:`triton_disagg.kv.overlap`). Every such request
  carries the request parameter ``peer_credential`` (:mod:`triton_disagg.triton.tensors`).
- Generation's tokens do not travel as Triton responses: a generation request
  names the orchestrator's ZeroMQ address and the request's key in the request
  parameter ``token_address`` (``<address>#<key>``: every event carries the key, a stop
  needs it) and its request id as the Triton request id; generation
  answers at once with one response, :data:`GENERATION_OUTPUTS` (the control
  address where stops for that request go), or an error, and streams the
  tokens to ``token_address`` (:mod:`triton_disagg.token_wire`). Every
  token stream ends with an event whose finish reason is set (``length``,
  ``stop``, ``stop_word``, ``cancelled``) or with an error.
- Preprocessing -> orchestrator: the engine inputs plus ``preprocessed`` (their seal: the
  orchestrator takes nothing else, :mod:`triton_disagg.triton.tensors`) and ``arrival_ns``, the
  preprocessing clock reading that starts the time-to-first-token metric.
- Orchestrator -> client: the orchestrator detokenizes; its outputs are the
  ensemble's outputs.

How these tensors become numpy dicts and token events, and back, is
:mod:`triton_disagg.triton.tensors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

MAX_BATCH_SIZE = 64

# request parameter carrying the phase (TensorRT-LLM's names)
REQUEST_TYPE = "request_type"
CONTEXT_ONLY = "context_only"
GENERATION_ONLY = "generation_only"
CONTEXT_AND_GENERATION = "context_and_generation"
# --overlap_kv_transfer: generation takes the request (the prompt alone) before the context
# prefills it, answers with a kv_listener for the context, says on the token stream when its
# blocks are taken (an event with no tokens: the context is called then), reads the KV as
# it lands.
GENERATION_AWAITING_CONTEXT = "generation_awaiting_context"
# generation_server.max_local_prefill_length: generation prefills and decodes the prompt
# itself when at most that many of its tokens are not in its prefix cache, else it declines
# (its answer's control address is empty) and the orchestrator goes to the context.
CONTEXT_AND_GENERATION_IF_CACHED = "context_and_generation_if_cached"
REQUEST_TYPES = (CONTEXT_ONLY, GENERATION_ONLY, CONTEXT_AND_GENERATION,
                 GENERATION_AWAITING_CONTEXT, CONTEXT_AND_GENERATION_IF_CACHED)
# Context only: give back the KV of a ``context_phase_params`` handle that will not be
# fetched (the client left before generation took it); any context instance takes it.
RELEASE_KV = "release_kv"
# Request parameter every orchestrator call to context or generation carries: the
# deployment's peer credential (triton_disagg.triton.tensors); without it both models refuse.
PEER_CREDENTIAL = "peer_credential"

_NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT8": np.uint8,
          "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the contract; its numpy dtype is looked up when it is declared, so an
    unknown Triton datatype fails at import, never on a request."""

    name: str
    dtype: str                  # Triton datatype: "BYTES", "INT32", ...
    dims: tuple[int, ...]       # without the batch dimension; -1 = variable
    optional: bool = False
    numpy_dtype: type = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numpy_dtype", _NUMPY[self.dtype])

    @property
    def pbtxt_type(self) -> str:
        return "TYPE_STRING" if self.dtype == "BYTES" else f"TYPE_{self.dtype}"


def _opt(name: str, dtype: str, dims: tuple[int, ...] = (1,)) -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional=True)


# ---- public: the ensemble ---------------------------------------------------------------

SAMPLING_INPUTS = (  # ensemble name -> same name on preprocessing and orchestrator
    _opt("end_id", "INT32"), _opt("pad_id", "INT32"), _opt("top_k", "INT32"),
    _opt("top_p", "FP32"), _opt("temperature", "FP32"), _opt("seed", "UINT64"),
    _opt("min_tokens", "INT32"), _opt("repetition_penalty", "FP32"),
    _opt("presence_penalty", "FP32"), _opt("frequency_penalty", "FP32"),
    _opt("stream", "BOOL"), _opt("return_log_probs", "BOOL"),
    _opt("exclude_input_in_output", "BOOL"), _opt("return_num_input_tokens", "BOOL"),
    _opt("return_num_output_tokens", "BOOL"),
    _opt("cache_salt", "BYTES"),    # UTF-8; prefixes are shared only among equal salts
    # k in [0, 20]: the prompt's own log-probs and k alternatives per position (PROMPT_LOGPROBS)
    _opt("prompt_logprobs", "INT32"),
    # k in [0, 20], with return_log_probs: k alternatives per generated token (TOP_LOGPROBS)
    _opt("top_logprobs", "INT32"),
)
# Accepted so that a request using them gets a clear error instead of "unexpected input".
UNSUPPORTED_INPUTS = (
    _opt("beam_width", "INT32"), _opt("num_return_sequences", "INT32"),
    _opt("length_penalty", "FP32"), _opt("lora_task_id", "UINT64"),
    _opt("lora_weights", "FP16", (-1, -1)), _opt("lora_config", "INT32", (-1, 3)),
    _opt("prompt_embedding_table", "FP16", (-1, -1)), _opt("prompt_vocab_size", "INT32"),
    _opt("guided_decoding_guide_type", "BYTES"), _opt("guided_decoding_guide", "BYTES"),
    _opt("return_context_logits", "BOOL"), _opt("return_generation_logits", "BOOL"),
)
# text_input and max_tokens are required, but declared optional: Triton 2.51 only counts
# a request's inputs against the required ones, so a request that lacks one but carries
# an optional input passes, the step needing it never runs, and the request ends with an
# empty success. Preprocessing refuses a missing one instead, by name.
ENSEMBLE_INPUTS = (
    _opt("text_input", "BYTES"),
    _opt("max_tokens", "INT32"),
    _opt("stop_words", "BYTES", (-1,)), _opt("bad_words", "BYTES", (-1,)),
) + SAMPLING_INPUTS + UNSUPPORTED_INPUTS
# Why a request's tokens ended, one vocabulary from generation to every client: the end
# token (stop), one of the request's stop words (stop_word), its max_tokens (length), or
# generation stopped it first (cancelled: a stop, a shutdown). It is token_wire's "finish",
# the engine's and the orchestrator's finish_reason tensor, and what the HTTP front maps to
# OpenAI's words (generation_routes.finish_reason); nobody works it out again from counts.
FinishReason = Literal["stop", "stop_word", "length", "cancelled"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
# With prompt_logprobs k, the context's answer (and the orchestrator's first response) carries,
# for each of the n prompt positions, the log-prob of its token given those before it, and
# the k most likely tokens there with their log-probs, most likely first; position 0 has none
# (NaN, ids -1). Computed by the prefill (engine.prompt_logprobs), so a request asking for them
# is always prefilled by a context, never on generation.
PROMPT_LOGPROBS = (
    TensorSpec("prompt_log_probs", "FP32", (-1,)),          # [n]
    TensorSpec("prompt_top_ids", "INT32", (-1, -1)),        # [n, k]
    TensorSpec("prompt_top_log_probs", "FP32", (-1, -1)),   # [n, k]
)
# With return_log_probs and top_logprobs k, a response carrying generated tokens also carries,
# for each of its n tokens, the k most likely tokens at that position with their log-probs
# (the raw model's, engine.logprobs), most likely first: the context's (its first token) and
# the orchestrator's. Generation's tokens bring theirs over token_wire.
TOP_LOGPROBS = (
    TensorSpec("output_top_ids", "INT32", (-1, -1, -1)),         # [beam=1, n, k]
    TensorSpec("output_top_log_probs", "FP32", (-1, -1, -1)),    # [beam=1, n, k]
)
ENSEMBLE_OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("cum_log_probs", "FP32", (-1,)),
    TensorSpec("output_log_probs", "FP32", (-1, -1)),
    TensorSpec("num_input_tokens", "INT32", (1,)),
    TensorSpec("num_output_tokens", "INT32", (1,)),
    TensorSpec("finish_reason", "BYTES", (1,)),         # a FinishReason: the final response only
    TensorSpec("num_cached_tokens", "INT32", (1,)),     # of num_input_tokens, served from cache
    # only when asked (top_logprobs, prompt_logprobs; TensorRT-LLM's ensemble has neither): the
    # alternatives beside output_log_probs, and the prompt's log-probs, as defined above
) + TOP_LOGPROBS + PROMPT_LOGPROBS

# ---- orchestrator <-> context / generation (TensorRT-LLM's tensorrt_llm model) -----------

ENGINE_INPUTS = (
    TensorSpec("input_ids", "INT32", (-1,)),
    TensorSpec("input_lengths", "INT32", (1,)),
    TensorSpec("request_output_len", "INT32", (1,)),
    _opt("end_id", "INT32"), _opt("pad_id", "INT32"), _opt("runtime_top_k", "INT32"),
    _opt("runtime_top_p", "FP32"), _opt("temperature", "FP32"), _opt("random_seed", "UINT64"),
    _opt("min_tokens", "INT32"), _opt("repetition_penalty", "FP32"),
    _opt("presence_penalty", "FP32"), _opt("frequency_penalty", "FP32"),
    _opt("stop_words_list", "INT32", (2, -1)), _opt("bad_words_list", "INT32", (2, -1)),
    _opt("streaming", "BOOL"), _opt("return_log_probs", "BOOL"), _opt("cache_salt", "BYTES"),
    _opt("prompt_logprobs", "INT32"), _opt("top_logprobs", "INT32"),
)
CONTEXT_PHASE_PARAMS = "context_phase_params"
# Generation's signed answer to a GENERATION_AWAITING_CONTEXT request, passed to the context
# unchanged: where to announce the KV as it lands (triton_disagg.kv.overlap_wire).
KV_LISTENER = "kv_listener"
# context_phase_params: the handle to hand back (RELEASE_KV) or to fetch (GENERATION_ONLY)
GENERATION_INPUTS = ENGINE_INPUTS + (_opt(CONTEXT_PHASE_PARAMS, "UINT8", (-1,)),)
CONTEXT_INPUTS = GENERATION_INPUTS + (_opt(KV_LISTENER, "UINT8", (-1,)),)
# request parameter: the orchestrator's ZeroMQ address where generation sends the tokens
TOKEN_ADDRESS = "token_address"
ENGINE_OUTPUTS = (
    TensorSpec("output_ids", "INT32", (-1, -1)),        # [beam=1, new tokens]
    TensorSpec("sequence_length", "INT32", (-1,)),      # [beam=1] tokens in output_ids
    TensorSpec("cum_log_probs", "FP32", (-1,)),         # [beam=1]
    TensorSpec("output_log_probs", "FP32", (-1, -1)),   # [beam=1, new tokens]
    TensorSpec("finish_reason", "BYTES", (-1,)),        # [beam=1] "" while running
)
# prompt tokens whose KV came from the context's prefix cache (not prefilled again)
NUM_CACHED_TOKENS = "num_cached_tokens"
CONTEXT_OUTPUTS = ENGINE_OUTPUTS + (TensorSpec(CONTEXT_PHASE_PARAMS, "UINT8", (-1,)),
                                    TensorSpec(NUM_CACHED_TOKENS, "INT32", (1,))
                                    ) + PROMPT_LOGPROBS + TOP_LOGPROBS
# Generation's one response per request: where the stops for that request go (empty: a
# CONTEXT_AND_GENERATION_IF_CACHED request declined), and (only for
# GENERATION_AWAITING_CONTEXT, else empty) the kv_listener for the context.
CONTROL_ADDRESS = "control_address"
GENERATION_OUTPUTS = (TensorSpec(CONTROL_ADDRESS, "BYTES", (1,)),
                      TensorSpec(KV_LISTENER, "UINT8", (-1,)))

# Ensemble sampling names -> engine names (TensorRT-LLM's ensemble mapping).
SAMPLING_TO_ENGINE = {
    "end_id": "end_id", "pad_id": "pad_id", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
    "temperature": "temperature", "seed": "random_seed", "min_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "stream": "streaming",
    "return_log_probs": "return_log_probs", "cache_salt": "cache_salt",
    "prompt_logprobs": "prompt_logprobs", "top_logprobs": "top_logprobs",
}

# ---- preprocessing -> orchestrator -> client ---------------------------------------------

# When the request reached preprocessing (CLOCK_MONOTONIC, ns; one clock for every process of
# the host): the orchestrator's time to first token starts there. Optional on the orchestrator,
# which then starts the clock itself (a caller that skips the ensemble).
ARRIVAL = "arrival_ns"
# HMAC of preprocessing's other outputs under a key derived from the deployment secret
# (triton_disagg.triton.tensors.seal): the orchestrator refuses a request without a
# matching one.
# Optional on the orchestrator so that its refusal, not Triton's, names what is missing.
PREPROCESSED = "preprocessed"
PREPROCESS_INPUTS = ENSEMBLE_INPUTS
PREPROCESS_OUTPUTS = ENGINE_INPUTS[:3] + (
    TensorSpec("stop_words_list", "INT32", (2, -1)),
    TensorSpec("bad_words_list", "INT32", (2, -1)),
    TensorSpec("end_id", "INT32", (1,)),
    TensorSpec("pad_id", "INT32", (1,)),
    TensorSpec(PREPROCESSED, "UINT8", (32,)),
    TensorSpec(ARRIVAL, "UINT64", (1,)),
)
ORCHESTRATOR_INPUTS = PREPROCESS_OUTPUTS[:-2] + (
    _opt(PREPROCESSED, "UINT8", (32,)), _opt(ARRIVAL, "UINT64")) + tuple(
    s for s in SAMPLING_INPUTS if s.name not in ("end_id", "pad_id"))
# The orchestrator detokenizes; with return_log_probs it also sends each response's token
# ids (the HTTP front names the tokens its log-probs are of), which the ensemble does not map.
# With prompt_logprobs, its first response also carries the context's PROMPT_LOGPROBS; with
# top_logprobs, each response the TOP_LOGPROBS of its tokens.
ORCHESTRATOR_OUTPUTS = ENSEMBLE_OUTPUTS + (TensorSpec("output_ids", "INT32", (-1, -1)),)
