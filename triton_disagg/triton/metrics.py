"""The project's Prometheus metrics, published through Triton's metrics endpoint.

Python backend custom metrics (``pb_utils.MetricFamily``); every metric carries
``role`` (orchestrator / context / generation) and ``model_instance`` (the Triton
model instance name) labels, so instances of one model never share a series. The
label is not ``instance``: Prometheus gives every scraped series ``instance`` (the
scrape target, host:port), and a target's own ``instance`` would be stored as
``exported_instance``.

- ``disagg_kv_blocks_used`` / ``disagg_kv_blocks_total`` (gauges): the instance's pool;
  used = held by live requests (0 at rest, whatever the prefix cache keeps).
- ``disagg_kv_blocks_cached`` (gauge): blocks of the pool holding a cached prompt prefix
  (held or free to evict).
- ``disagg_prefix_cache_queries_total`` / ``disagg_prefix_cache_hits_total`` (counters, in
  tokens): prompt tokens looked up in the prefix cache, and those whose KV it held (hit
  rate: ``rate(hits) / rate(queries)``); ``disagg_prefix_cache_prefilled_total`` (counter,
  tokens): of the looked-up tokens the cache did not hold, those the instance computed
  (on generation the rest were fetched from a context); ``disagg_prefix_cache_evictions_total``
  (counter): cached blocks given to other KV.
- ``disagg_live_sequences`` (gauge, generation): sequences the instance's decode loop
  holds, decoding or waiting for their KV blocks.
- ``disagg_queued_prompt_tokens`` (gauge, context): prompt tokens the instance has taken
  from Triton's queue and not yet prefilled (Triton's own queue is
  ``nv_inference_pending_request_count``, in requests).
- ``disagg_kv_transfer_bytes_total`` (counter), ``disagg_kv_transfer_seconds``
  (histogram): KV fetched by generation, label ``strategy``.
- ``disagg_kv_fetch_seconds`` (histogram, generation): per request, its KV's time in
  flight: from the fetch's start on the decode loop to the KV in place (queueing on the
  instance's fetch thread included), label ``strategy``.
- ``disagg_kv_fetch_hidden_seconds`` (histogram, generation): per request, the part of that
  time in flight during which the instance computed (prefill or decode passes) for other
  sequences, label ``strategy``; one sample per ``disagg_kv_fetch_seconds`` sample, never
  larger. The hidden share is ``rate(..._hidden_seconds_sum) / rate(disagg_kv_fetch_seconds_sum)``;
  an idle instance's fetch hides ~0 s (and stalls nothing).
- ``disagg_decode_steps_blocked_by_transfer_total`` (counter, generation): decode steps
  whose admission waited on a KV transfer (more than 1 ms in fetch starts and polls;
  expected 0: fetches run on their own thread).
- ``disagg_preemptions_total`` (counter, generation): running sequences whose KV blocks
  the scheduler took back for an older one (``MAX_UTILIZATION``), to be recomputed here.
- ``disagg_kv_leases_expired_total`` (counter): handoffs never fetched, reclaimed.
- ``disagg_requests_total`` (counter): finished requests by ``outcome``
  (finished / cancelled / error).
- ``disagg_dropped_frames_total`` (counter): frames a reader loop dropped, labels
  ``reader`` (e.g. ``orchestrator token inbox``) and ``reason`` (``malformed``,
  ``bad_key``, ``unknown_request``; :mod:`triton_disagg.readers`).
- ``disagg_time_to_first_token_seconds``, ``disagg_time_per_output_token_seconds``
  (histograms), measured by the orchestrator; TTFT starts when the request reached
  preprocessing (``protocol.ARRIVAL``) and ends when the first token's response is sent.

The scheduler's routing (orchestrator over gRPC; :mod:`grpc_transport`, :mod:`pools`), with
``server_role`` (context / generation) and ``server`` (the url) labels:

- ``disagg_routed_requests_total`` (counter): calls routed to each server (a context
  call tried again counts once per server it went to).
- ``disagg_route_retries_total`` (counter): context calls tried again elsewhere because
  ``server`` did not answer.
- ``disagg_migrations_total`` (counter): requests moved off generation server
  ``server`` because it was lost with them (:class:`~triton_disagg.errors.GenerationLost`).
- ``disagg_pool_members`` (gauge, ``server_role`` only): servers in the role's pool.
- ``disagg_etcd_reachable`` (gauge): 1 while etcd answers the scheduler's polls, else 0
  (only with discovery).
- ``disagg_route_decisions_total`` (counter, ``server_role`` and ``mode``): a ``kv_aware``
  router's picks by mode: ``overlap``, ``load``, ``fallback`` (:mod:`triton_disagg.routing.router`).
- ``disagg_kv_event_batches_total`` (counter, ``publisher`` and ``outcome``: ``received`` /
  ``missed``): KV event batches from each publisher a ``kv_aware`` router follows.

Every update is applied on the instance's own writer thread, in order: each one is an
IPC round trip to the Triton process, which the decode loop, the orchestrator's event
loop and ``execute`` must not wait for. Updates made after :meth:`Metrics.close` are
dropped.

Invariant: the MetricFamily objects live until :meth:`Metrics.close` (Triton drops a
family's series when its Python object is collected). Models call ``close`` in
``finalize``: a family still alive when the stub process tears itself down crashes
it (Triton 2.51's Python backend; docs/architecture.md, "Triton behaviours worked
around"), and every server stop would wait out Triton's exit timeout.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator
# Any here: Triton's pb_utils module and its metric objects, which have no types.

if TYPE_CHECKING:
    from triton_disagg.engine.block_pool import PoolStats

# Fine below 2.5 ms: a one-host KV handoff takes about a millisecond (bench handoff).
LATENCY_BUCKETS = [0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_FAMILIES = {
    "kv_blocks_used": ("disagg_kv_blocks_used", "KV blocks in use in this instance's pool", "GAUGE"),
    "kv_blocks_total": ("disagg_kv_blocks_total", "KV blocks in this instance's pool", "GAUGE"),
    "kv_blocks_cached": ("disagg_kv_blocks_cached",
                         "KV blocks holding a cached prompt prefix (held or evictable)", "GAUGE"),
    "prefix_queries": ("disagg_prefix_cache_queries_total",
                       "Prompt tokens looked up in the prefix cache", "COUNTER"),
    "prefix_hits": ("disagg_prefix_cache_hits_total",
                    "Prompt tokens whose KV the prefix cache held", "COUNTER"),
    "prefix_prefilled": ("disagg_prefix_cache_prefilled_total",
                         "Looked-up prompt tokens not in the prefix cache that this instance "
                         "prefilled (not fetched)", "COUNTER"),
    "prefix_evictions": ("disagg_prefix_cache_evictions_total",
                         "Cached KV blocks evicted for other KV", "COUNTER"),
    "live_sequences": ("disagg_live_sequences",
                       "Sequences this generation instance holds (decoding or waiting for KV)",
                       "GAUGE"),
    "queued_prompt_tokens": ("disagg_queued_prompt_tokens",
                             "Prompt tokens this context instance accepted and has not prefilled",
                             "GAUGE"),
    "kv_bytes": ("disagg_kv_transfer_bytes_total", "KV bytes fetched from context", "COUNTER"),
    "kv_seconds": ("disagg_kv_transfer_seconds", "Seconds per KV fetch", "HISTOGRAM"),
    "kv_fetch_seconds": ("disagg_kv_fetch_seconds",
                         "Seconds a request's KV was in flight, fetch start to KV in place",
                         "HISTOGRAM"),
    "kv_fetch_hidden": ("disagg_kv_fetch_hidden_seconds",
                        "Seconds of a request's KV in flight hidden behind other sequences' "
                        "compute", "HISTOGRAM"),
    "steps_blocked": ("disagg_decode_steps_blocked_by_transfer_total",
                      "Decode steps that waited on a KV transfer", "COUNTER"),
    "preemptions": ("disagg_preemptions_total",
                    "Running sequences preempted (KV freed, recomputed later) when the pool "
                    "ran out", "COUNTER"),
    "leases_expired": ("disagg_kv_leases_expired_total",
                       "KV handoffs reclaimed because their lease expired", "COUNTER"),
    "requests": ("disagg_requests_total", "Requests by outcome", "COUNTER"),
    "dropped_frames": ("disagg_dropped_frames_total",
                       "Frames a reader loop dropped (malformed, without their request's key, "
                       "for a request it does not hold)", "COUNTER"),
    "ttft": ("disagg_time_to_first_token_seconds", "Time to first token", "HISTOGRAM"),
    "tpot": ("disagg_time_per_output_token_seconds", "Time per output token after the first",
             "HISTOGRAM"),
    "routed": ("disagg_routed_requests_total", "Calls routed to each server", "COUNTER"),
    "retries": ("disagg_route_retries_total",
                "Context calls tried again elsewhere because this server did not answer",
                "COUNTER"),
    "migrations": ("disagg_migrations_total",
                   "Requests moved off this generation server because it was lost", "COUNTER"),
    "members": ("disagg_pool_members", "Servers in the role's pool", "GAUGE"),
    "etcd": ("disagg_etcd_reachable", "1 while etcd answers the scheduler, else 0", "GAUGE"),
    "decisions": ("disagg_route_decisions_total",
                  "kv_aware routing decisions by mode (overlap, load, fallback)", "COUNTER"),
    "kv_events": ("disagg_kv_event_batches_total",
                  "KV event batches received or missed per publisher", "COUNTER"),
}


class _Ignored:
    """Stands in for a metric after :meth:`Metrics.close`: every update does nothing."""

    def set(self, value: float) -> None:
        pass

    increment = observe = set


_IGNORED = _Ignored()
MODEL_INSTANCE = "model_instance"   # the label naming the Triton model instance (see above)
CLOSE_WAIT_SECONDS = 5.0      # for the writer to apply what was queued before close
_log = logging.getLogger(__name__)


class Metrics:
    def __init__(self, pb_utils: Any, role: str, instance: str):
        self.pb, self.labels = pb_utils, {"role": role, MODEL_INSTANCE: instance}
        kinds = {"GAUGE": pb_utils.MetricFamily.GAUGE, "COUNTER": pb_utils.MetricFamily.COUNTER,
                 "HISTOGRAM": pb_utils.MetricFamily.HISTOGRAM}
        self.families = {key: pb_utils.MetricFamily(name=name, description=doc, kind=kinds[kind])
                         for key, (name, doc, kind) in _FAMILIES.items()}
        self._series: dict[tuple, Any] = {}
        self._totals_seen: dict[tuple, int] = {}
        self._closed = False      # no update is taken any more
        self._released = False    # the writer is done: no series is made any more
        self._updates: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name=f"metrics-{role}", daemon=True)
        self._writer.start()

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """Close when the block raises: a model whose ``initialize`` fails gets no
        ``finalize``, and its stub would crash on the live families while it exits."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Apply the updates taken so far, then release every series, then every family (in
        that order, as Triton requires); later updates are ignored. Call it from
        ``finalize`` once no thread updates."""
        if not self._closed:
            self._closed = True
            self._updates.put(None)
            self._writer.join(CLOSE_WAIT_SECONDS)
            self._released = True
        self._series.clear()
        self.families.clear()

    def _later(self, update: Callable[[], None]) -> None:
        if not self._closed:
            self._updates.put(update)

    def _write(self) -> None:
        while (update := self._updates.get()) is not None:
            try:
                update()
            except Exception:  # noqa: BLE001 - a metric must never take the model down
                _log.exception("metrics update failed")

    def _metric(self, key: str, **extra: str) -> Any:
        if self._released:
            return _IGNORED
        labels = dict(self.labels, **extra)
        ident = (key, tuple(sorted(labels.items())))
        if ident not in self._series:
            kind = _FAMILIES[key][2]
            kwargs = {"buckets": LATENCY_BUCKETS} if kind == "HISTOGRAM" else {}
            self._series[ident] = self.families[key].Metric(labels=labels, **kwargs)
        return self._series[ident]

    def kv_pool(self, stats: "PoolStats") -> None:
        """The pool's gauges and the prefix cache's counters (running totals: only the
        increase is added)."""
        self._later(lambda: (self._metric("kv_blocks_used").set(stats.used),
                             self._metric("kv_blocks_total").set(stats.total),
                             self._metric("kv_blocks_cached").set(stats.cached),
                             self._add_total("prefix_queries", stats.query_tokens),
                             self._add_total("prefix_hits", stats.hit_tokens),
                             self._add_total("prefix_prefilled", stats.prefilled_tokens),
                             self._add_total("prefix_evictions", stats.evicted_blocks)))

    def live_sequences(self, count: int) -> None:
        self._later(lambda: self._metric("live_sequences").set(count))

    def queued_prompt_tokens(self, tokens: int) -> None:
        self._later(lambda: self._metric("queued_prompt_tokens").set(tokens))

    def kv_transfer(self, strategy: str, nbytes: int, seconds: float,
                    in_flight_seconds: float, hidden_seconds: float) -> None:
        self._later(lambda: (
            self._metric("kv_bytes", strategy=strategy).increment(nbytes),
            self._metric("kv_seconds", strategy=strategy).observe(seconds),
            self._metric("kv_fetch_seconds", strategy=strategy).observe(in_flight_seconds),
            self._metric("kv_fetch_hidden", strategy=strategy).observe(hidden_seconds)))

    def leases_expired(self, total: int) -> None:
        """``total``: the lease table's running count; only the increase is added."""
        self._later(lambda: self._add_total("leases_expired", total))

    def steps_blocked_by_transfer(self, total: int) -> None:
        """``total``: the scheduler's running count; only the increase is added."""
        self._later(lambda: self._add_total("steps_blocked", total))

    def preemptions(self, total: int) -> None:
        """``total``: the scheduler's running count; only the increase is added."""
        self._later(lambda: self._add_total("preemptions", total))

    def _add_total(self, key: str, total: int, **labels: str) -> None:
        metric = self._metric(key, **labels)        # the series shows from the start, at 0
        seen_key = (key, *sorted(labels.items()))
        seen = self._totals_seen.get(seen_key, 0)
        if total > seen:
            metric.increment(total - seen)
            self._totals_seen[seen_key] = total

    def request_done(self, outcome: str) -> None:
        self._later(lambda: self._metric("requests", outcome=outcome).increment(1))

    def dropped_frame(self, reader: str, reason: str) -> None:
        """One frame ``reader`` dropped (:class:`triton_disagg.readers.DroppedFrames`)."""
        self._later(lambda: self._metric("dropped_frames", reader=reader,
                                         reason=reason).increment(1))

    # orchestrator observer interface
    def first_token(self, seconds: float) -> None:
        self._later(lambda: self._metric("ttft").observe(seconds))

    def finished(self, outcome: str, seconds: float, tokens: int, ttft: float | None) -> None:
        self.request_done(outcome)
        if ttft is not None and tokens > 1:
            self._later(lambda: self._metric("tpot").observe((seconds - ttft) / (tokens - 1)))

    # router observer interface (grpc_transport.GrpcTransport, pools.Pools)
    def routed(self, role: str, url: str) -> None:
        self._later(lambda: self._metric("routed", server_role=role, server=url).increment(1))

    def retried(self, role: str, url: str) -> None:
        self._later(lambda: self._metric("retries", server_role=role, server=url).increment(1))

    def migrated(self, url: str) -> None:
        self._later(lambda: self._metric("migrations", server_role="generation",
                                         server=url).increment(1))

    def members(self, role: str, count: int) -> None:
        self._later(lambda: self._metric("members", server_role=role).set(count))

    def etcd_reachable(self, reachable: bool) -> None:
        self._later(lambda: self._metric("etcd").set(1 if reachable else 0))

    def route_decision(self, role: str, mode: str) -> None:
        self._later(lambda: self._metric("decisions", server_role=role, mode=mode).increment(1))

    def kv_event_batches(self, publisher: str, received: int, missed: int) -> None:
        """Running counts of one publisher's batches; only the increases are added."""
        for outcome, total in (("received", received), ("missed", missed)):
            self._later(lambda outcome=outcome, total=total: self._add_total(
                "kv_events", total, publisher=publisher, outcome=outcome))
