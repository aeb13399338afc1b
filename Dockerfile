# Two targets:
#   docker build --target cpu -t triton-disagg:cpu .   embedded Triton from the nvidia-pytriton wheel
#   docker build --target gpu -t triton-disagg:gpu .   NGC Triton with the TensorRT-LLM backend
# Both serve the numpy reference engine on the CPU today: the gpu image only swaps in NGC's
# tritonserver, ready for the TensorRT-LLM engines that builders/ does not produce yet.
# Neither image downloads model weights: mount a checkpoint or engine directory at run time.
# Run with a /dev/shm big enough for the Python backend and the KV staging area
# (docker run --shm-size=1g ...; Docker's default of 64 MB is too small).

FROM python:3.11-slim AS cpu
WORKDIR /opt/triton-disagg
COPY . .
RUN pip install --no-cache-dir -e . \
 && triton-disagg demo-checkpoint --output checkpoints/demo \
 && triton-disagg build --checkpoint checkpoints/demo --output engines/demo
EXPOSE 8000 8001 8002
CMD ["triton-disagg", "run", "--engine", "engines/demo", "--text", "Hello", "--max-tokens", "16"]

FROM nvcr.io/nvidia/tritonserver:24.10-trtllm-python-py3 AS gpu
WORKDIR /opt/triton-disagg
COPY . .
RUN pip install --no-cache-dir -e .
ENV TRITON_DISAGG_TRITONSERVER=/opt/tritonserver/bin/tritonserver
EXPOSE 8000 8001 8002
CMD ["triton-disagg", "--help"]
