"""The torch forward pass of both families over the paged KV cache (CPU float32, or CUDA).

The same math as :mod:`triton_disagg.engine.model` (the numpy reference) and the same
entry points (``prefill``, ``prefill_keeping``, ``prefill_all_logits``, ``decode``,
``max_context``), so the
engine's control logic (scheduler, block pool, sampling) stays the one copy and only
the runner differs. Logits come back as float32 numpy arrays on the host.

KV storage: on CPU the runner computes straight in the pool's numpy array
(``torch.from_numpy(pool.array)`` shares its memory), so the KV connectors that register
that array move it in place. On CUDA it owns one device tensor of the pool's shape and the
pool has no host array: the blocks of a handoff pass through a bounded staging buffer
(:class:`~triton_disagg.kv.device_staging.DeviceStaging`) by
:meth:`TorchModelRunner.blocks_to_host` before an export and
:meth:`TorchModelRunner.blocks_to_device` after a fetch.

Invariants (as the numpy runner): a pass writes the K/V of exactly the positions it
computes (token ``t`` of a sequence at slot ``t % bs`` of its ``t // bs``-th block) and
reads only the blocks the caller names; it never allocates or frees blocks. A query at
position ``p`` sees exactly the keys at positions ``0..p`` of its own sequence, so a
prompt may continue a sequence whose earlier KV is already cached.
"""

from __future__ import annotations

from typing import Collection, Sequence

import contextlib
import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from triton_disagg.engine.block_pool import BlockPool
from triton_disagg.engine.model import Batch, LayerDone, LogitRows, length_groups, prefill_item
from triton_disagg.engine.rope import inv_frequencies, rope_tables
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.engine.torch_device import (SERVING_SDPA_BACKENDS,
                                               SINGLE_THREAD_ATTENTION_BYTES, TORCH_DTYPES,
                                               OneCpuThread, on_runner_device, torch_dtype)


class TorchModelRunner:
    """Runs prefill and decode batches of one engine against one :class:`BlockPool`."""

    def __init__(self, spec: EngineSpec, weights: dict[str, np.ndarray | torch.Tensor],
                 pool: BlockPool, device: str = "cpu", dtype: str = "float32",
                 sdpa_backends: Sequence[SDPBackend] | None = SERVING_SDPA_BACKENDS):
        """``sdpa_backends``: the attention backends a pass may use (None: torch's own
        choice, for checks that compare against it)."""
        s = self.shape = spec.shape
        g = pool.geometry
        spec.check_pool(g)
        self.pool, self.device, self.dtype = pool, torch.device(device), TORCH_DTYPES[dtype]
        self.gpt2 = s.family == "gpt2"
        self.q_dim, self.kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.max_context = spec.max_context
        self.bs = g.tokens_per_block
        self.sdpa_backends = None if sdpa_backends is None else list(sdpa_backends)
        to = self._to_device
        self.layers = [{key.split(".", 2)[2]: to(w) for key, w in weights.items()
                        if key.startswith(f"layers.{i}.")} for i in range(s.num_layers)]
        self.embed = to(weights["embed"])                                  # [V, H]
        self.pos_embed = to(weights["pos_embed"]) if self.gpt2 else None   # [P, H]
        self.lm_head = to(weights["lm_head.weight"]) if "lm_head.weight" in weights else self.embed
        self.final_norm = (to(weights["final_norm.weight"]),
                           to(weights["final_norm.bias"]) if self.gpt2 else None)
        if self.device.type == "cpu":
            self.kv = torch.from_numpy(pool.array)     # [N, L, 2, bs, kvh, hd], shares memory
        else:
            self.kv = torch.zeros((pool.num_total, *g.block_shape), dtype=self.dtype,
                                  device=self.device)          # [N, L, 2, bs, kvh, hd]
        if not self.gpt2:
            cos, sin = rope_tables(inv_frequencies(s.head_dim, s.rope_theta, s.rope_scaling),
                                   self.max_context)
            self.cos = torch.from_numpy(cos).to(self.device)                # [P, hd/2] float32
            self.sin = torch.from_numpy(sin).to(self.device)

    def _to_device(self, w: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A weight (numpy, or a tensor already made on the device) on the runner's device
        and dtype (on CPU float32: no copy)."""
        return torch.as_tensor(w).to(device=self.device, dtype=self.dtype)

    # ---- public entry points -------------------------------------------------------

    def prefill(self, batch: Batch, on_layer: LayerDone | None = None) -> np.ndarray:
        """Logits ``[B, V]`` at each prompt's last position; writes the prompts' KV.

        ``batch`` holds ``(token_ids, block_ids)`` per sequence, tokens from position 0, or
        ``(token_ids, block_ids, num_cached)``: only the tokens after a cached prefix of
        ``num_cached`` are computed, attending to its KV in the pool (as the numpy runner's).
        ``on_layer(li)``: as the numpy runner's (on CUDA, once the layer's writes are
        issued: a reader of device memory synchronises first).
        """
        return self.prefill_keeping(batch, (), on_layer)[0]

    @on_runner_device
    def prefill_keeping(self, batch: Batch, keep: Collection[int], on_layer: LayerDone | None = None
                        ) -> tuple[np.ndarray, dict[int, LogitRows]]:
        """:meth:`prefill`'s logits ``[B, V]``, and for each prompt index in ``keep`` the
        logits of every computed position, made on demand (as the numpy runner's; each kept
        prompt's hidden states ``[n, H]`` are copied out of the batch's, so the batch's
        padded ``[B, n_max, H]`` is freed with the step, and stay on the device until dropped)."""
        hidden, lengths = self._prefill_hidden(batch, on_layer)            # [B, n, H]
        last = hidden[torch.arange(len(lengths)), torch.tensor(lengths) - 1]  # [B, H]
        return self._logits(last), {b: LogitRows(n, len(self.lm_head),
                                                 functools.partial(self._logit_rows, hidden[b, :n].clone()))
                                    for b, n in enumerate(lengths) if b in keep}

    def prefill_all_logits(self, batch: Batch) -> list[np.ndarray]:
        """Like :meth:`prefill`, but the logits ``[n_i, V]`` of every computed position of
        each prompt (those after its cached prefix)."""
        return [rows.all() for rows in self.prefill_keeping(batch, range(len(batch)))[1].values()]

    @on_runner_device
    def _logit_rows(self, hidden: torch.Tensor, start: int, stop: int) -> np.ndarray:
        """Float32 host logits ``[stop - start, V]`` of rows ``start:stop`` of one prompt's
        ``hidden [n, H]``."""
        return self._logits(hidden[start:stop])

    @on_runner_device
    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               block_tables: Sequence[Sequence[int]]) -> np.ndarray:
        """One new token per sequence at ``positions`` (its KV slot); returns logits ``[B, V]``.

        Sequence ``b`` attends to positions ``0..positions[b]`` of ``block_tables[b]``,
        padded only to the longest of its length group (:func:`length_groups`).
        """
        pos = torch.tensor(positions, dtype=torch.int64).unsqueeze(1)      # [B, 1]
        tok = torch.tensor(tokens, dtype=torch.int64).unsqueeze(1)         # [B, 1]
        groups = length_groups(np.asarray(positions) // self.bs + 1)       # by blocks read
        if len(groups) == 1:                                               # 0..B-1 in order
            attention = [(None, self._paged_batch(pos, [1] * len(tokens), block_tables,
                                                  fresh=False))]
        else:
            attention = [(torch.from_numpy(index).to(self.device),             # [G]
                          self._paged_batch(pos[torch.from_numpy(index)], [1] * len(index),
                                            [block_tables[i] for i in index], fresh=False))
                         for index in groups]
        hidden = self._forward(tok, pos, attention)                        # [B, 1, H]
        return self._logits(hidden[:, 0])

    # ---- staging (CUDA: the KV connectors move host bytes) -------------------------

    @on_runner_device
    def blocks_to_host(self, block_ids: Sequence[int], host: np.ndarray, rows: Sequence[int],
                       layers: range | None = None) -> None:
        """Copy device blocks ``block_ids`` (only ``layers`` of each, if given) into rows
        ``rows`` of ``host`` ``[R, L, 2, bs, kvh, hd]``, in its dtype (a staging buffer,
        :class:`~triton_disagg.kv.device_staging.DeviceStaging`)."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        span = slice(None) if layers is None else slice(layers.start, layers.stop)
        moved = self.kv.index_select(0, ids)[:, span].to("cpu", torch_dtype(host.dtype))
        host[np.asarray(rows, dtype=np.int64), span] = moved.numpy()  # [m, l, 2, bs, kvh, hd]

    @on_runner_device
    def blocks_to_device(self, block_ids: Sequence[int], host: np.ndarray,
                         rows: Sequence[int]) -> None:
        """Copy rows ``rows`` of ``host`` (a KV connector just filled them) into device
        blocks ``block_ids``, in the device KV's dtype."""
        moved = torch.from_numpy(host[np.asarray(rows, dtype=np.int64)])  # [m, L, 2, bs, kvh, hd]
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        self.kv.index_copy_(0, ids, moved.to(self.device, self.kv.dtype))

    # ---- internals -------------------------------------------------------------------

    def _prefill_hidden(self, batch: Batch, on_layer: LayerDone | None = None
                        ) -> tuple[torch.Tensor, list[int]]:
        """Final-norm hidden states ``[B, n_max, H]`` of the prompts' computed tokens (those
        after each one's cached prefix), right-padded, and each prompt's count of them (rows
        past it are padding: computed, never written to KV)."""
        items = [prefill_item(item) for item in batch]
        lengths = [len(ids) - cached for ids, _, cached in items]
        n_max = max(lengths)
        tok = torch.zeros((len(batch), n_max), dtype=torch.int64)          # [B, n]
        for b, (ids, _, cached) in enumerate(items):
            tok[b, :lengths[b]] = torch.tensor(ids[cached:], dtype=torch.int64)
        pos = torch.arange(n_max).expand(len(batch), n_max)               # [B, n]
        pos = torch.minimum(pos, torch.tensor(lengths).unsqueeze(1) - 1)   # padding repeats last
        cached = torch.tensor([c for _, _, c in items])                    # [B]
        pos = pos + cached.unsqueeze(1)                                     # after the prefix
        paged = self._paged_batch(pos, lengths, [blocks for _, blocks, _ in items],
                                  fresh=not bool(cached.any()))
        return self._forward(tok, pos, [(None, paged)], on_layer), lengths

    def _forward(self, tok: torch.Tensor, pos: torch.Tensor,
                 attention: list[tuple[torch.Tensor | None, "_PagedBatch"]],
                 on_layer: LayerDone | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[B, n, H]`` of tokens ``tok`` ``[B, n]`` at positions
        ``pos`` ``[B, n]``. ``attention``: ``(rows, paged)`` groups that together hold every
        row of the batch once (``rows`` None: all of them, in order); each group writes and
        attends through its own :class:`_PagedBatch` (see :meth:`_paged_batch`).
        """
        tok, pos = tok.to(self.device), pos.to(self.device)
        x = self.embed[tok]                                                # [B, n, H]
        cos = sin = None
        if self.gpt2:
            x = x + self.pos_embed[pos]
        else:
            cos, sin = self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)  # [B, n, 1, hd/2]
        with (contextlib.nullcontext() if self.sdpa_backends is None
              else sdpa_kernel(self.sdpa_backends)):
            x = self._layers(x, cos, sin, attention, on_layer)
        return self._norm(x, *self.final_norm)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                attention: list[tuple[torch.Tensor | None, "_PagedBatch"]],
                on_layer: LayerDone | None) -> torch.Tensor:
        """Every decoder layer over ``x`` ``[B, n, H]`` (see :meth:`_forward`)."""
        s = self.shape
        b, n = x.shape[:2]
        for li, w in enumerate(self.layers):
            h = self._norm(x, w["attn_norm.weight"], w.get("attn_norm.bias"))
            qkv = F.linear(h, w["qkv.weight"], w.get("qkv.bias"))          # [B, n, Q + 2*KV]
            qk = qkv[..., :self.q_dim + self.kv_dim].view(
                b, n, s.num_heads + s.num_kv_heads, s.head_dim)            # [B, n, nh+kvh, hd]
            if not self.gpt2:
                qk = _rope(qk, cos, sin)       # queries and keys in one rotation
            q, k = qk[:, :, :s.num_heads], qk[:, :, s.num_heads:]          # [B, n, nh|kvh, hd]
            v = qkv[..., self.q_dim + self.kv_dim:].view(b, n, s.num_kv_heads, s.head_dim)
            o = self._grouped_attention(li, q, k, v, attention)            # [B, n, Q]
            if on_layer is not None:                     # layer li's K/V is in the pool
                on_layer(li)
            x = x + F.linear(o, w["o.weight"], w.get("o.bias"))
            x = x + self._mlp(self._norm(x, w["mlp_norm.weight"], w.get("mlp_norm.bias")), w)
        return x

    def _paged_batch(self, pos: torch.Tensor, lengths: Sequence[int],
                     block_tables: Sequence[Sequence[int]], fresh: bool) -> "_PagedBatch":
        """Where a pass (or one group of it) writes and reads the pool (layer 0; layer ``l``
        adds ``l * 2 * bs`` to write rows and ``l * 2`` to read rows), and how it masks.
        ``pos`` ``[B, n]`` (host); only the first ``lengths[b]`` tokens of row ``b`` are
        real: only their K/V is written. Every sequence's gathered keys are positions
        ``0..span-1`` of its blocks, span = the largest position + 1 rounded up to blocks;
        a query attends the first ``key_len`` = largest position + 1 of them.

        No mask is materialised for ``fresh`` prompts (every row's tokens are at positions
        ``0..n-1``, no cached prefix): query ``i`` sees keys ``0..i``, which is SDPA's
        ``is_causal`` over ``n`` keys (padding rows then see padding keys; they are
        discarded). A decode group whose sequences are all at one position needs none
        either; one whose positions differ gets a ``[B, 1, 1, key_len]`` key-length mask
        (``B * key_len`` bytes) until a paged attention kernel reads each sequence's own
        length."""
        layers, (b, n) = self.shape.num_layers, pos.shape
        nb = -(-(int(pos.max()) + 1) // self.bs)
        table = torch.zeros((b, nb), dtype=torch.int64)                    # [B, nb]; pad: block 0
        for i, ids in enumerate(block_tables):
            used = min(nb, len(ids))
            table[i, :used] = torch.tensor(ids[:used], dtype=torch.int64)
        real = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).nonzero(as_tuple=True)
        real_pos = pos[real]                                               # [R]
        slot_block = table[real[0], real_pos // self.bs]                   # [R]
        # Pool as token rows [N * L * 2 * bs, KV]: slot (block, offset) of layer l, K/V c
        # is row ((block * L + l) * 2 + c) * bs + offset.
        write_rows = slot_block * (layers * 2 * self.bs) + real_pos % self.bs      # [R]
        # Pool as block rows [N * L * 2, bs * KV]: block of layer l, K/V c is row
        # (block * L + l) * 2 + c.
        read_rows = (table[:, None, :] * (layers * 2)
                     + torch.arange(2)[None, :, None]).flatten()           # [B * 2 * nb]
        key_len = int(pos.max()) + 1
        mask = None
        if not fresh and bool((pos != pos.flatten()[0]).any()):
            key_pos = torch.arange(key_len)                                # [K]
            mask = (key_pos[None, None, :] <= pos[:, :, None]).unsqueeze(1)    # [B, 1, n, K]
        small = len(read_rows) * self.bs * self.kv_dim * 4 <= SINGLE_THREAD_ATTENTION_BYTES
        threads = (OneCpuThread() if self.device.type == "cpu" and small
                   else contextlib.nullcontext())
        dev = self.device
        every = len(write_rows) == b * n        # no padding (decode, equal prompts)
        return _PagedBatch(None if every else tuple(r.to(dev) for r in real), write_rows.to(dev),
                           read_rows.to(dev), None if mask is None else mask.to(dev),
                           fresh, nb * self.bs, key_len, threads)

    def _grouped_attention(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           attention: list[tuple[torch.Tensor | None, "_PagedBatch"]]
                           ) -> torch.Tensor:
        """:meth:`_paged_attention` of each group's rows of ``q``/``k``/``v``
        ``[B, n, heads, hd]`` -> ``[B, n, Q]``."""
        if len(attention) == 1 and attention[0][0] is None:              # the whole batch
            return self._paged_attention(li, q, k, v, attention[0][1])
        o = q.new_empty(q.shape[0], q.shape[1], self.q_dim)                # [B, n, Q]
        for rows, paged in attention:
            o[rows] = self._paged_attention(li, q[rows], k[rows], v[rows], paged)  # [G, n, Q]
        return o

    def _paged_attention(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         paged: "_PagedBatch") -> torch.Tensor:
        """Write the real tokens' ``k``/``v`` ``[B, n, kvh, hd]`` into layer ``li`` of the
        pool, then attend ``q`` ``[B, n, nh, hd]`` over the gathered blocks -> ``[B, n, Q]``."""
        s = self.shape
        b, n = q.shape[:2]
        token_rows = self.kv.view(-1, self.kv_dim)                         # [N*L*2*bs, KV]
        block_rows = self.kv.view(-1, self.bs * self.kv_dim)               # [N*L*2, bs*KV]
        with paged.threads:
            k_rows = paged.write_rows + li * 2 * self.bs
            token_rows.index_copy_(0, k_rows, paged.real_rows(k).to(self.kv.dtype))   # [R, KV]
            token_rows.index_copy_(0, k_rows + self.bs, paged.real_rows(v).to(self.kv.dtype))
            cached = block_rows.index_select(0, paged.read_rows + li * 2).to(q.dtype)  # [B*2*nb, bs*KV]
            cached = cached.view(b, 2, paged.span, s.num_kv_heads, s.head_dim)  # [B, 2, S, kvh, hd]
            keys = cached[:, 0, :paged.key_len]                            # [B, K, kvh, hd]
            vals = cached[:, 1, :paged.key_len]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                attn_mask=paged.mask, is_causal=paged.causal, enable_gqa=True)  # [B, nh, n, hd]
        return o.transpose(1, 2).reshape(b, n, self.q_dim)                 # [B, n, Q]

    def _logits(self, hidden: torch.Tensor) -> np.ndarray:
        """``hidden [R, H]`` -> float32 host logits ``[R, V]``."""
        return F.linear(hidden, self.lm_head).float().cpu().numpy()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """LayerNorm when there is a bias (gpt2), else RMSNorm, over the last axis of ``x``."""
        eps = self.shape.norm_eps
        if bias is not None:
            return F.layer_norm(x, weight.shape, weight, bias, eps)
        return F.rms_norm(x, weight.shape, weight, eps)

    def _mlp(self, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.gpt2:
            a = F.linear(h, w["fc.weight"], w["fc.bias"])                  # [B, n, I]
            return F.linear(F.gelu(a, approximate="tanh"), w["proj.weight"], w["proj.bias"])
        gate, up = F.linear(h, w["gate_up.weight"]).chunk(2, dim=-1)      # [B, n, I] each
        return F.linear(F.silu(gate) * up, w["down.weight"])


@dataclass(frozen=True)
class _PagedBatch:
    """One pass's pool addressing (see :meth:`TorchModelRunner._paged_batch`)."""

    real: tuple[torch.Tensor, torch.Tensor] | None   # (row, column) of each real token,
                                                      # [R] each; None: every token is real
    write_rows: torch.Tensor                   # [R] token row of each real token's K, layer 0
    read_rows: torch.Tensor                    # [B * 2 * nb] block rows to gather, layer 0
    mask: torch.Tensor | None                  # [B, 1, n, K] bool: key visible to query
    causal: bool                               # fresh prompts: key i visible to queries >= i
    span: int                                  # S = nb * bs keys gathered per sequence
    key_len: int                               # K <= S keys attended (largest position + 1)
    threads: contextlib.AbstractContextManager  # for the attention ops

    def real_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The real tokens' rows of ``t`` ``[B, n, heads, hd]`` -> ``[R, heads * hd]``."""
        rows = t if self.real is None else t[self.real]                    # [B, n | R, ...]
        return rows.reshape(-1, t.shape[2] * t.shape[3])                   # [R, heads*hd]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, n, heads, hd]`` rotated by HF's rotate_half convention (see ``rope.py``);
    ``cos``/``sin`` are ``[B, n, 1, hd/2]`` float32."""
    x1, x2 = x.float().chunk(2, dim=-1)                                    # [B, n, heads, hd/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

