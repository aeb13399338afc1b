"""How the torch runner calls attention, checked on CPU by recording its SDPA calls: fresh
prompts and equal-length decode groups materialise no mask, decode of unequal lengths a
key-length mask only; serving never lets SDPA pick cuDNN (a graph build per new shape);
every entry point runs with the runner's CUDA device current in the calling thread.

The only fakes are at the GPU boundary: ``torch.cuda.device`` / ``set_device`` recorders
(no GPU here) and a recording ``device_scope``."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import triton_disagg.engine.torch_device as torch_device
import triton_disagg.engine.torch_model as torch_model
from triton_disagg.engine.block_pool import BlockPool
from triton_disagg.engine.llm_engine import LLMEngine
from triton_disagg.engine.runtime import Runtime, make_runner
from triton_disagg.kv.layout import BlockGeometry


@pytest.fixture(scope="module")
def runner(tiny_checkpoints, tmp_path_factory):
    from triton_disagg.builders.build import build_engine

    out = tmp_path_factory.mktemp("attention") / "llama"
    build_engine(tiny_checkpoints["llama"], out, tokens_per_block=4, max_batch_size=4)
    return LLMEngine(out, runtime=Runtime("torch", "cpu", "float32")).runner


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every SDPA call's mask shape (None: no mask), is_causal, key length and whether
    cuDNN attention was allowed at the time; the real SDPA still computes."""
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append(SimpleNamespace(
            mask=None if attn_mask is None else tuple(attn_mask.shape), causal=is_causal,
            keys=k.shape[2], cudnn=torch.backends.cuda.cudnn_sdp_enabled()))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch_model.F, "scaled_dot_product_attention", recording)
    return calls


def test_fresh_prompts_attend_causally_without_a_mask(runner, sdpa_calls):
    runner.prefill([(list(range(3, 13)), [0, 1, 2]), (list(range(5, 11)), [3, 4])])
    layers = runner.shape.num_layers
    assert len(sdpa_calls) == layers
    assert all(c.mask is None and c.causal and c.keys == 10 for c in sdpa_calls)


def test_decode_masks_only_when_lengths_differ(runner, sdpa_calls):
    runner.prefill([(list(range(3, 13)), [0, 1, 2]), (list(range(5, 13)), [3, 4, 5])])
    sdpa_calls.clear()
    runner.decode([7, 8], [10, 10], [[0, 1, 2], [3, 4, 5]])          # one length: no mask
    assert all(c.mask is None and not c.causal and c.keys == 11 for c in sdpa_calls)
    sdpa_calls.clear()
    runner.decode([9, 9], [11, 9], [[0, 1, 2], [3, 4, 5]])           # lengths 12 and 10
    assert all(c.mask == (2, 1, 1, 12) and not c.causal for c in sdpa_calls)


def test_serving_never_lets_sdpa_choose_cudnn(runner, sdpa_calls):
    assert torch.backends.cuda.cudnn_sdp_enabled()          # torch's default outside a pass
    runner.prefill([(list(range(3, 9)), [0, 1])])
    runner.decode([4], [6], [[0, 1]])
    assert sdpa_calls and not any(c.cudnn for c in sdpa_calls)
    assert torch.backends.cuda.cudnn_sdp_enabled()          # restored after the pass


def test_every_entry_point_enters_the_runner_device_in_the_calling_thread(runner, monkeypatch):
    entered = []

    @contextlib.contextmanager
    def recording_scope(device):
        entered.append((threading.current_thread().name, str(device)))
        yield

    monkeypatch.setattr(torch_device, "device_scope", recording_scope)
    runner.prefill([(list(range(3, 9)), [0, 1])])
    worker = threading.Thread(target=runner.decode, args=([4], [6], [[0, 1]]), name="loop")
    host = np.zeros((2, *runner.pool.geometry.block_shape), runner.pool.array.dtype)
    fetch = threading.Thread(target=runner.blocks_to_device, args=([0, 1], host, [0, 1]),
                             name="fetch")
    for thread in (worker, fetch):
        thread.start()
        thread.join()
    runner.blocks_to_host([0], host, [1])
    main = threading.current_thread().name
    assert entered == [(main, "cpu"), ("loop", "cpu"), ("fetch", "cpu"), (main, "cpu")]


def test_device_scope_makes_the_cuda_device_current(monkeypatch):
    made = []

    class FakeCudaDevice(contextlib.nullcontext):
        def __init__(self, device):
            made.append(str(device))
            super().__init__()

    monkeypatch.setattr(torch.cuda, "device", FakeCudaDevice)
    with torch_device.device_scope(torch.device("cuda", 2)):
        pass
    with torch_device.device_scope(torch.device("cpu")):
        pass
    assert made == ["cuda:2"]


def test_a_cuda_instance_sets_its_device_before_building_the_runner(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set", index)))

    class FakeCudaRunner:                   # the GPU boundary: records where it was built
        def __init__(self, spec, weights, pool, device, dtype):
            calls.append(("runner", device))

    monkeypatch.setattr(torch_model, "TorchModelRunner", FakeCudaRunner)
    pool = BlockPool(BlockGeometry(2, 4, 8, 16, "float32"), 4)
    make_runner(Runtime("torch", "cuda", "bfloat16", 2), SimpleNamespace(),
                {"embed": np.zeros((4, 4), np.float32)}, pool)
    assert calls == [("set", 2), ("runner", "cuda:2")]
