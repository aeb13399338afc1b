"""The numpy float32 forward pass of both families, with a paged KV cache.

``llama`` (Llama, Qwen2, Mistral): RMSNorm, rotary embeddings, GQA, gated SiLU MLP.
``gpt2``: learned positions, LayerNorm with bias, biases everywhere, gelu_new MLP.

Invariants: a forward pass writes the K/V of exactly the positions it computes into
the pool (token ``t`` of a sequence at slot ``t % bs`` of its ``t // bs``-th block) and
reads only the blocks the caller names; it never allocates or frees blocks. A prefill
after a cached prefix computes only the positions after it (they attend to the prefix's
KV in the pool), so it never writes a cached block. All math
is float32 on the weights as loaded (no per-step weight copies).

Decode batches are split into length groups (:func:`length_groups`, the torch runner's
too): a decode step pads every sequence of an attention call to the longest one's blocks.
One long prompt joining short streams would make every stream read its length; grouping the
batch by blocks used bounds that padding (``PADDING_LIMIT``) at the cost of one attention
call per group. Rotary tables come from :mod:`.rope` (Hugging Face's); :func:`apply_rope`
rotates by them here (the torch runner has its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Collection, Sequence, Union

import numpy as np

from triton_disagg.engine.rope import inv_frequencies, rope_tables
from triton_disagg.engine.spec import EngineSpec
from triton_disagg.engine.block_pool import BlockPool

Attention = Callable[[int, np.ndarray, np.ndarray], np.ndarray]
LayerDone = Callable[[int], None]   # prefill hook: layer ``li``'s K/V of every prompt is in the pool
# One prompt of a prefill: (token_ids, block_ids) or (token_ids, block_ids, num_cached).
PrefillItem = Union[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int], int]]
Batch = Sequence[PrefillItem]
PADDING_LIMIT = 2   # a decode group reads at most this many times the blocks its sequences use


@dataclass(frozen=True)
class LogitRows:
    """The logits of ``num_rows`` positions of one prompt, made on demand: ``rows(start,
    stop)`` -> float32 ``[stop - start, vocab_size]``. Holds only the prompt's final hidden
    states (``num_rows * H``, H << V), so a reader that takes a few rows at a time never has
    the ``[num_rows, V]`` array (``engine.prompt_logprobs``)."""

    num_rows: int
    vocab_size: int
    rows: Callable[[int, int], np.ndarray]

    def all(self) -> np.ndarray:
        """Every row at once, ``[num_rows, V]`` (tests; a request path reads chunks)."""
        return self.rows(0, self.num_rows)


def prefill_item(item: PrefillItem) -> tuple[Sequence[int], Sequence[int], int]:
    """``(token_ids, block_ids, num_cached)`` of a prefill batch entry (both runners'):
    ``num_cached`` tokens of KV are already in the blocks, at least one token is computed."""
    ids, blocks, cached = (*item, 0) if len(item) == 2 else item
    if not 0 <= cached < len(ids):
        raise ValueError(f"a prompt of {len(ids)} tokens cannot start after {cached} cached "
                         f"tokens; its last token is always computed")
    return ids, blocks, int(cached)


SMALL_BATCH_ROWS = 16
# Rows of the weight per BLAS call for small batches: about 1 MiB, so the BLAS's packed
# copy of each slice stays in the core's L2 cache instead of making a second trip to memory.
SMALL_BATCH_SLICE_BYTES = 1 << 20
# Attention scores per chunk of a prompt's rows in a prefill: 4 MiB (about 124 rows of a
# 1,056-token prompt with 8 heads) keeps them in cache; one [heads, n, n] block of a long
# prompt is many times that and made a cold prefill's attention 3x slower (bench prefix).
ATTENTION_CHUNK_BYTES = 4 << 20


def _matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x [T, in] @ w[out, in].T -> [T, out]``.

    The BLAS call is picked by row count, as measured with this numpy's OpenBLAS: one row
    is a gemv; up to ``SMALL_BATCH_ROWS`` rows, ``w @ x.T`` over slices of about
    ``SMALL_BATCH_SLICE_BYTES`` of the weight (OpenBLAS packs the weight operand, and a
    slice's packed copy stays in L2) runs 1.3-1.8x faster than one ``x @ w.T``; more rows
    (prefill) are a plain gemm. The result may be Fortran-ordered; callers only slice or
    add to it.
    """
    rows = x.shape[0]
    if rows == 1:
        return (w @ x[0])[None]                      # [1, out]
    if rows <= SMALL_BATCH_ROWS:
        out = np.empty((w.shape[0], rows), dtype=np.float32)   # [out, T]
        step = max(1, SMALL_BATCH_SLICE_BYTES // (w.shape[1] * w.itemsize))
        xt = x.T                                     # [in, T]
        for start in range(0, w.shape[0], step):
            np.matmul(w[start:start + step], xt, out=out[start:start + step])
        return out.T                                 # [out, T] -> [T, out]
    return x @ w.T


def _softmax_(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place (rows of all ``-inf`` are not allowed)."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


class ModelRunner:
    """Runs prefill and decode batches of one engine against one :class:`BlockPool`."""

    def __init__(self, spec: EngineSpec, weights: dict[str, np.ndarray], pool: BlockPool):
        s = self.shape = spec.shape
        spec.check_pool(pool.geometry)
        self.pool = pool
        self.gpt2 = s.family == "gpt2"
        self.q_dim = s.num_heads * s.head_dim
        self.group = s.num_heads // s.num_kv_heads
        self.scale = np.float32(1.0 / math.sqrt(s.head_dim))
        self.layers = [{key.split(".", 2)[2]: w for key, w in weights.items()
                        if key.startswith(f"layers.{i}.")} for i in range(s.num_layers)]
        self.embed = weights["embed"]
        self.pos_embed = weights.get("pos_embed")
        self.lm_head = weights.get("lm_head.weight", self.embed)     # [V, H]
        self.final_norm = (weights["final_norm.weight"], weights.get("final_norm.bias"))
        self.max_context = spec.max_context   # longest prompt + generated sequence
        if not self.gpt2:
            inv_freq = inv_frequencies(s.head_dim, s.rope_theta, s.rope_scaling)
            self.cos, self.sin = rope_tables(inv_freq, self.max_context)

    # ---- public entry points -------------------------------------------------------

    def prefill(self, batch: Batch, on_layer: LayerDone | None = None) -> np.ndarray:
        """Logits ``[B, V]`` at each prompt's last position; writes the prompts' KV.

        ``batch`` holds ``(token_ids, block_ids)`` per sequence, tokens from position 0, or
        ``(token_ids, block_ids, num_cached)``: the KV of the first ``num_cached`` tokens
        is already in the blocks (a cached prefix; ``num_cached < len(token_ids)``), and
        only the rest is computed, attending to it.
        ``on_layer(li)`` is called once per layer, in order, as soon as that layer's K/V
        of every prompt is in the pool (before the later layers are computed): the point
        where a layer group's KV can start moving while the prefill goes on.
        """
        return self.prefill_keeping(batch, (), on_layer)[0]

    def prefill_keeping(self, batch: Batch, keep: Collection[int],
                        on_layer: LayerDone | None = None
                        ) -> tuple[np.ndarray, dict[int, LogitRows]]:
        """:meth:`prefill`'s logits ``[B, V]``, and for each prompt index in ``keep`` the
        logits ``[n_b, V]`` of every computed position (those after its cached prefix),
        made a chunk of rows at a time on demand (:class:`LogitRows`)."""
        hidden, bounds = self._prefill_hidden(batch, on_layer)
        last = _matmul(hidden[[stop - 1 for _, stop in bounds]], self.lm_head)   # [B, V]
        return last, {b: LogitRows(stop - start, len(self.lm_head),
                                   partial(self._logit_rows, hidden[start:stop]))
                      for b, (start, stop) in enumerate(bounds) if b in keep}

    def prefill_all_logits(self, batch: Batch) -> list[np.ndarray]:
        """Like :meth:`prefill`, but the logits ``[n_i, V]`` of every computed position of
        each prompt (those after its cached prefix)."""
        return [rows.all() for rows in self.prefill_keeping(batch, range(len(batch)))[1].values()]

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               block_tables: Sequence[Sequence[int]]) -> np.ndarray:
        """One new token per sequence at ``positions`` (its KV slot); returns logits ``[B, V]``.

        Sequence ``b`` attends to positions ``0..positions[b]`` of ``block_tables[b]``.
        """
        positions = np.asarray(positions, dtype=np.int64)
        bs = self.pool.geometry.tokens_per_block
        used = positions // bs + 1                      # blocks each sequence reads
        groups = [(index, self._attention_inputs(positions[index], used[index],
                                                 [block_tables[i] for i in index]))
                  for index in length_groups(used)]
        attend = partial(self._grouped_attention, groups)
        blocks = np.array([ids[p // bs] for ids, p in zip(block_tables, positions.tolist())],
                          dtype=np.int64)               # [B] block of each new token
        hidden = self._forward(np.asarray(tokens, dtype=np.int64), positions,
                               (blocks, positions % bs), attend)
        return _matmul(hidden, self.lm_head)

    # ---- internals -------------------------------------------------------------------

    def _logit_rows(self, hidden: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Logits ``[stop - start, V]`` of rows ``start:stop`` of one prompt's ``hidden [n, H]``."""
        return _matmul(hidden[start:stop], self.lm_head)

    def _prefill_hidden(self, batch: Batch, on_layer: LayerDone | None = None
                        ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Final-norm hidden states ``[T, H]`` of the computed tokens of all prompts
        concatenated, and each prompt's ``(start, stop)`` rows."""
        items = [prefill_item(item) for item in batch]
        tokens = np.concatenate([np.asarray(ids[cached:], dtype=np.int64)
                                 for ids, _, cached in items])
        lengths = [len(ids) - cached for ids, _, cached in items]
        starts = np.cumsum([0] + lengths)
        bounds = list(zip(starts[:-1].tolist(), starts[1:].tolist()))
        per_prompt = [np.arange(cached, len(ids)) for ids, _, cached in items]
        positions = np.concatenate(per_prompt)
        bs = self.pool.geometry.tokens_per_block
        tables = [np.asarray(blocks, dtype=np.int64) for _, blocks, _ in items]
        blocks = np.concatenate([table[p // bs] for table, p in zip(tables, per_prompt)])
        prefixes = [(cached, table) for (_, _, cached), table in zip(items, tables)]
        attend = partial(self._causal_attention, bounds, prefixes)
        return self._forward(tokens, positions, (blocks, positions % bs), attend,
                             on_layer), bounds

    def _forward(self, tokens: np.ndarray, positions: np.ndarray,
                 slots: tuple[np.ndarray, np.ndarray], attend: Attention,
                 on_layer: LayerDone | None = None) -> np.ndarray:
        """Final-norm hidden states ``[T, H]`` of ``tokens`` at ``positions``; ``on_layer``
        as :meth:`prefill` says."""
        s = self.shape
        t = len(tokens)
        x = self.embed[tokens]                          # [T, H]
        if self.gpt2:
            x += self.pos_embed[positions]
        else:
            cos, sin = self.cos[positions], self.sin[positions]     # [T, hd/2]
        blocks, offsets = slots
        for li, w in enumerate(self.layers):
            h = self._norm(x, w["attn_norm.weight"], w.get("attn_norm.bias"))
            qkv = self._linear(h, w, "qkv")                    # [T, Q + 2*KV]
            q = qkv[:, :self.q_dim].reshape(t, s.num_heads, s.head_dim)       # [T, nh, hd]
            kv = qkv[:, self.q_dim:].reshape(t, 2, s.num_kv_heads, s.head_dim)  # [T, 2, kvh, hd]
            if not self.gpt2:
                apply_rope(q, cos, sin)
                apply_rope(kv[:, 0], cos, sin)
            self.pool.array[blocks, li, :, offsets] = kv   # slot of token i <- [2, kvh, hd]
            if on_layer is not None:
                on_layer(li)
            x += self._linear(attend(li, q, kv), w, "o")
            x += self._mlp(self._norm(x, w["mlp_norm.weight"], w.get("mlp_norm.bias")), w)
        return self._norm(x, *self.final_norm)

    def _causal_attention(self, bounds: list[tuple[int, int]],
                          prefixes: list[tuple[int, np.ndarray]], li: int, q: np.ndarray,
                          kv: np.ndarray) -> np.ndarray:
        """Each prompt's rows ``[start, stop)`` attend causally to themselves and to its
        cached prefix (``prefixes``: ``(num_cached, block table)`` per prompt, the KV of
        positions ``0..num_cached-1`` read from layer ``li`` of the pool); returns ``[T, Q]``.
        A prompt's rows go in chunks whose scores take about ``ATTENTION_CHUNK_BYTES``, each
        against only the keys it can see (causal: up to its last row), so a long cold prompt
        neither materialises ``[heads, n, n]`` scores nor computes their masked half; K and V
        are made contiguous once, so each head's product is one BLAS call."""
        s = self.shape
        kvh, g, hd = s.num_kv_heads, self.group, s.head_dim
        out = np.empty((len(q), self.q_dim), dtype=np.float32)
        for (start, stop), (cached, table) in zip(bounds, prefixes):
            n = stop - start
            keys = kv[start:stop]                               # [n, 2, kvh, hd]
            if cached:
                keys = np.concatenate([self._cached_kv(li, table, cached), keys])  # [c+n, ...]
            ks = np.ascontiguousarray(keys[:, 0].transpose(1, 2, 0))   # [kvh, hd, c+n]
            vs = np.ascontiguousarray(keys[:, 1].transpose(1, 0, 2))   # [kvh, c+n, hd]
            rows = max(1, ATTENTION_CHUNK_BYTES // (4 * s.num_heads * (cached + n)))
            for a in range(0, n, rows):
                b = min(n, a + rows)
                r, width = b - a, cached + b                    # keys rows a..b-1 can see
                qs = q[start + a:start + b].reshape(r, kvh, g, hd)            # [r, kvh, g, hd]
                qs = (qs.transpose(1, 0, 2, 3) * self.scale).reshape(kvh, r * g, hd)
                scores = (qs @ ks[:, :, :width]).reshape(kvh, r, g, width)  # [kvh, r, g, w]
                scores += np.triu(np.full((r, width), -np.inf, dtype=np.float32),
                                  cached + a + 1)[None, :, None, :]
                o = _softmax_(scores.reshape(kvh, r * g, width)) @ vs[:, :width]  # [kvh, r*g, hd]
                out[start + a:start + b] = (o.reshape(kvh, r, g, hd).transpose(1, 0, 2, 3)
                                            .reshape(r, self.q_dim))          # [r, Q]
        return out

    def _cached_kv(self, li: int, table: np.ndarray, num_cached: int) -> np.ndarray:
        """Layer ``li``'s K/V of positions ``0..num_cached-1`` of the sequence whose blocks
        are ``table``, as float32 ``[num_cached, 2, kvh, hd]``."""
        bs = self.pool.geometry.tokens_per_block
        positions = np.arange(num_cached)
        return self.pool.array[table[positions // bs], li, :, positions % bs].astype(
            np.float32, copy=False)                             # [c, 2, kvh, hd]

    def _attention_inputs(self, positions: np.ndarray, used: np.ndarray,
                          block_tables: Sequence[Sequence[int]]
                          ) -> tuple[np.ndarray, np.ndarray]:
        """Pool rows and mask bias of one group of a decode batch (padded to its longest)."""
        bs, num_layers = self.pool.geometry.tokens_per_block, self.shape.num_layers
        nb = int(used.max())
        table = np.zeros((len(positions), nb), dtype=np.int64)   # [B, nb]; pad with block 0
        for b, (ids, n) in enumerate(zip(block_tables, used)):
            table[b, :n] = ids[:n]
        # Row of block t, layer l, K/V c in the pool viewed as [N * L * 2, bs * kvh * hd].
        rows = (table[None, :, None, :] * (num_layers * 2)            # [L, B, 2, nb]
                + np.arange(num_layers)[:, None, None, None] * 2
                + np.arange(2)[None, None, :, None])
        visible = np.arange(nb * bs)[None, :] <= positions[:, None]     # [B, nb*bs]
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)
        return rows, bias[:, None, None, :]                               # [B, 1, 1, nb*bs]

    def _grouped_attention(self, groups: list, li: int, q: np.ndarray,
                           kv: np.ndarray) -> np.ndarray:
        """Decode attention of each group ``(batch indices, (rows, bias))``; ``[B, Q]``."""
        if len(groups) == 1:                            # the whole batch, in order
            return self._paged_attention(*groups[0][1], li, q, kv)
        out = np.empty((len(q), self.q_dim), dtype=np.float32)
        for index, (rows, bias) in groups:
            out[index] = self._paged_attention(rows, bias, li, q[index], kv[index])
        return out

    def _paged_attention(self, rows: np.ndarray, bias: np.ndarray, li: int,
                         q: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """Decode attention over the cached blocks ``rows[li]``; returns ``[B, Q]``."""
        s = self.shape
        b, _, nb = rows[li].shape
        pool = self.pool.array.reshape(-1, self.pool.array[0, 0, 0].size)  # [N*L*2, bs*kvh*hd]
        gathered = pool.take(rows[li], axis=0)                  # [B, 2, nb, bs*kvh*hd]
        gathered = gathered.astype(np.float32, copy=False)
        k = gathered[:, 0].reshape(b, -1, s.num_kv_heads, s.head_dim)     # [B, nb*bs, kvh, hd]
        v = gathered[:, 1].reshape(b, -1, s.num_kv_heads, s.head_dim)     # [B, nb*bs, kvh, hd]
        qg = q.reshape(b, s.num_kv_heads, self.group, s.head_dim) * self.scale  # [B, kvh, g, hd]
        scores = qg @ k.transpose(0, 2, 3, 1)                   # [B, kvh, g, nb*bs]
        scores += bias
        o = _softmax_(scores) @ v.transpose(0, 2, 1, 3)         # [B, kvh, g, hd]
        return o.reshape(b, self.q_dim)                         # [B, Q]

    def _norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """LayerNorm when there is a bias (gpt2), else RMSNorm, over the last axis of ``x``."""
        eps = self.shape.norm_eps
        if bias is not None:
            centered = x - x.mean(axis=-1, keepdims=True)
            var = np.mean(centered * centered, axis=-1, keepdims=True)
            return centered / np.sqrt(var + eps) * weight + bias
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + eps) * weight

    @staticmethod
    def _linear(x: np.ndarray, w: dict, name: str) -> np.ndarray:
        y = _matmul(x, w[name + ".weight"])
        bias = w.get(name + ".bias")
        if bias is not None:
            y += bias
        return y

    def _mlp(self, h: np.ndarray, w: dict) -> np.ndarray:
        if self.gpt2:
            a = self._linear(h, w, "fc")                        # [T, I]
            inner = a * a * a
            inner *= 0.044715
            inner += a
            inner *= math.sqrt(2 / math.pi)
            np.tanh(inner, out=inner)
            inner += 1.0
            inner *= 0.5
            inner *= a                                          # gelu_new(a)
            return self._linear(inner, w, "proj")
        gate_up = _matmul(h, w["gate_up.weight"])               # [T, 2I]
        half = gate_up.shape[1] // 2
        gate, up = gate_up[:, :half], gate_up[:, half:]
        act = np.tanh(gate * 0.5)
        act += 1.0
        act *= 0.5
        act *= gate                                             # silu(gate) = gate * sigmoid(gate)
        act *= up
        return _matmul(act, w["down.weight"])


def length_groups(used: np.ndarray) -> list[np.ndarray]:
    """Batch indices grouped by ``used`` (blocks each sequence reads) so that padding every
    sequence of a group to its longest reads at most ``PADDING_LIMIT`` times the blocks
    they use: one long prompt joining short streams is attended on its own instead of
    making every stream read its length. Every index is in exactly one group; each group's
    indices ascend (so a single group is ``0..B-1`` in order)."""
    order = np.argsort(used, kind="stable")
    groups, start, total = [], 0, 0
    for end, i in enumerate(order):
        total += int(used[i])
        if (end + 1 - start) * int(used[i]) > PADDING_LIMIT * total and end > start:
            groups.append(np.sort(order[start:end]))
            start, total = end, int(used[i])
    groups.append(np.sort(order[start:]))
    return groups


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate ``x`` ``[T, heads, hd]`` in place; ``cos``/``sin`` are ``[T, hd/2]`` (HF's
    rotate_half convention, :mod:`.rope`)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]        # [T, 1, hd/2]
    x1, x2 = x[..., :half], x[..., half:]          # views [T, heads, hd/2]
    rotated_first = x1 * c - x2 * s
    x2 *= c
    x2 += x1 * s
    x1[...] = rotated_first
