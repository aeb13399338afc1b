# Two targets, the images `triton-disagg launch k8s --image` names (docs/deploy.md):
#   docker build --target cpu -t triton-disagg:cpu .   embedded Triton from the nvidia-pytriton wheel
#   docker build --target gpu -t triton-disagg:gpu .   NGC Triton with the TensorRT-LLM backend
# Which runtime runs the engine is chosen where it serves (triton_disagg/engine/runtime.py,
# Runtime.default, unless model.runtime/device say): the cpu image has no GPU build of torch
# and runs it on the CPU (numpy, the CPU default; model.runtime: torch takes [cpu]'s torch);
# the gpu image runs it with torch on CUDA (bfloat16) when the container sees a GPU.
# Neither image downloads model weights: the cpu image carries the demo engine (seeded
# random weights, built here) at /opt/triton-disagg/engines/demo; mount others at run time.
#
# A plain `docker run` needs a /dev/shm bigger than Docker's 64 MB default: Triton's Python
# backend keeps about 1 MiB per model instance there, and kv_cache.strategy host_memory
# stages each context instance's whole KV pool (kv_cache.max_size) there too. Give
# --shm-size of at least the context instances' max_size together plus 64 MB, e.g.
#   docker run --rm --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 8080:8080 triton-disagg:cpu
# (8080: the HTTP front, OpenAI API and /v1/inference; README, "Ports")
# (Kubernetes: the rendered pods mount an emptyDir of medium Memory at /dev/shm, sized so.)
#
# Docker's and Kubernetes' default profiles allow tritonserver no /dev/shm of its own, and
# serve refuses the shared one unless TRITON_DISAGG_ALLOW_SHARED_SHM says otherwise: both
# images set it to `container`, which allows the container's own /dev/shm and refuses, in one
# line, a container that shares the host's IPC namespace (docker run --ipc=host, Kubernetes
# hostIPC: true), whose /dev/shm is the host's, every user's. `-e TRITON_DISAGG_ALLOW_SHARED_SHM=1`
# serves there anyway (docs/deploy.md, "The image"; docs/architecture.md, trust boundaries, says
# what a host user who reads the container's command lines can still do).
#
# Every server role runs `triton-disagg serve ROLE ...` (the pods' command); the default
# command serves every model in one server on 0.0.0.0 with the demo engine.
#
# Both images run as the user triton-disagg (uid and gid 10001, launch/k8s_workloads.py's
# RUN_AS, which the rendered pods ask for), never root. It owns only the work directory
# (/opt/triton-disagg/work, where serve writes: the model repository, logs, the peers
# gate) and its home (caches); the code and the demo engine stay root's, read-only to it.
# It also writes /tmp and /dev/shm. Not being root, serve gets no private /dev/shm
# (no user namespace under the default profiles), hence TRITON_DISAGG_ALLOW_SHARED_SHM.

FROM python:3.11-slim AS cpu
WORKDIR /opt/triton-disagg
ENV TRITON_DISAGG_ALLOW_SHARED_SHM=container
COPY . .
# The official python image ships libpython3.11.so, which Triton's Python-backend stub
# loads; `doctor` fails the build, with the fix, if the stub cannot start. Installed as a
# user's `pip install` would (not editable): the model templates come from the package.
# `.[cpu]`, with torch's CPU build from PyTorch's index first (on PyPI torch==2.13.0 is the
# CUDA build, ~4 GB of CUDA libraries; README, "What each install pulls").
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir ".[cpu]" \
 && triton-disagg doctor \
 && triton-disagg demo-checkpoint --output checkpoints/demo \
 && triton-disagg build --checkpoint checkpoints/demo --output engines/demo
RUN groupadd --gid 10001 triton-disagg \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin triton-disagg \
 && install -d -o 10001 -g 10001 work
USER 10001:10001
EXPOSE 8000 8001 8002 8080
CMD ["triton-disagg", "serve", "all", "--engine", "engines/demo", "--host", "0.0.0.0"]

FROM nvcr.io/nvidia/tritonserver:24.10-trtllm-python-py3 AS gpu
WORKDIR /opt/triton-disagg
COPY . .
# serve finds NGC's tritonserver through this variable (triton_disagg/triton/tritonserver.py), not the
# nvidia-pytriton wheel's; `doctor` checks that its Python-backend stub loads this Python.
ENV TRITON_DISAGG_TRITONSERVER=/opt/tritonserver/bin/tritonserver \
    TRITON_DISAGG_ALLOW_SHARED_SHM=container
# `.[gpu]` (README, "What each install pulls"): torch's CUDA build, 2.5 or newer, which
# model.device: cuda needs (SDPA's enable_gqa); pip keeps the NGC image's torch if it is
# that new, else installs PyPI's newest CUDA build over it.
RUN pip install --no-cache-dir ".[gpu]" \
 && triton-disagg doctor
RUN groupadd --gid 10001 triton-disagg \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin triton-disagg \
 && install -d -o 10001 -g 10001 work
USER 10001:10001
EXPOSE 8000 8001 8002 8080
CMD ["triton-disagg", "--help"]
