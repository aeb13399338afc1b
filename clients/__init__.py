"""Clients of the served ensemble (installed as ``triton_disagg.clients``).

- :mod:`.stream`: one generate request over gRPC streaming or HTTP
  ``generate``/``generate_stream``, timed (TTFT, time per output token,
  inter-token gaps, token counts);
- :mod:`.health`: is the server reachable, ready, and the model ready;
- :mod:`.workload`: prompt and output lengths drawn from distributions;
- :mod:`.cli`: ``triton-disagg client "prompt"``;
- ``locustfile.py``: locust users for both protocols;
- ``examples/``: short scripts to copy.
"""
