"""A server's registration: its record under a lease, kept alive by a heartbeat thread.

:meth:`Registration.start` grants a lease of ``ttl_seconds`` and puts the server's
:class:`~.record.MemberRecord` at ``{prefix}/{role}/{grpc_url}`` under it. Every beat
(``min(1 s, ttl / 3)``) the thread refreshes the lease, reads the load callable (the server's
load and each of its models': :class:`~.record.Loads`) and puts
the record again when it changed, so the load in etcd is at most about a second old.

Invariants:

- The key is only ever written under the lease currently held; at most one lease is held.
- A lease etcd no longer knows (it lapsed, or etcd lost its data) is replaced by a new
  one and the record is put again at the next beat: the registration comes back by itself.
- While etcd does not answer, the lease is kept (etcd restarted on its data dir still
  knows it) and every beat tries again; one log line when etcd stops answering, one when
  it answers again.
- After :meth:`close` returns, the thread has exited and the lease is revoked (which
  deletes the key at once) if etcd answered; otherwise the key lapses within the TTL.
  Revoking touches only keys under this lease, never a newer server's at the same url.
- A load callable that raises keeps the last load (logged once per failing streak).
- Any other exception in a beat (etcd answering with an error, or a reply without the
  fields expected, such as a keepalive without ``result``) drops the lease held and the
  next beat registers under a fresh one; logged once per streak of one error type. The
  heartbeat never stops on its own (:class:`.periodic.Periodic`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from triton_disagg.config.discovery_section import DiscoveryConfig

from .etcd import ETCD_ERRORS, UNREACHABLE, connect, member_key
from .periodic import Periodic
from .record import Loads, MemberRecord

_log = logging.getLogger(__name__)


class Registration:
    def __init__(self, discovery: DiscoveryConfig, record: MemberRecord,
                 load: Callable[[], Loads] | None = None):
        self.discovery, self.record = discovery, record
        self.key = member_key(discovery.prefix, record.role, record.grpc_url)
        self.beat_seconds = min(1.0, discovery.ttl_seconds / 3)
        # A request may take at most one beat, so a slow etcd cannot stall the lease.
        self._client = connect(discovery, timeout=self.beat_seconds)
        self._load = load
        self._last_load = Loads(record.load, tuple(m.load for m in record.models))
        self._lease = None              # etcd3gw Lease currently held, or None
        self._published: MemberRecord | None = None   # what etcd holds under self._lease
        self._etcd_down = False
        self._load_failing = False
        self._refusal: str | None = None    # the error of the current refused streak, logged once
        self._heartbeat = Periodic(self._beat, self.beat_seconds, f"etcd-registration {self.key}")

    @property
    def registered(self) -> bool:
        """Whether the last beat left the record in etcd under a live lease."""
        return self._published is not None and not self._etcd_down

    def start(self) -> "Registration":
        """Register now (or log that etcd does not answer yet) and start the heartbeat."""
        self._heartbeat.start()
        return self

    def close(self) -> None:
        """Stop the heartbeat, then revoke the lease (deleting the key)."""
        self._heartbeat.stop()
        if self._lease is None:
            return
        try:
            self._lease.revoke()
            _log.info("etcd: deregistered %s", self.key)
        except ETCD_ERRORS as exc:
            _log.warning("etcd at %s: could not revoke the lease of %s (%s); the key lapses "
                         "within %d s", self.discovery.etcd, self.key, exc,
                         self.discovery.ttl_seconds)
        self._lease = self._published = None

    def _beat(self) -> None:
        try:
            if self._lease is not None and self._lease.refresh() <= 0:
                _log.warning("etcd at %s: the lease of %s is gone; registering again",
                             self.discovery.etcd, self.key)
                self._lease = None
            if self._lease is None:
                self._lease, self._published = self._client.lease(self.discovery.ttl_seconds), None
            record = self.record.with_loads(self._read_load())
            if record != self._published:
                self._client.put(self.key, record.to_json(), lease=self._lease)
                self._published = record
        except UNREACHABLE as exc:
            if not self._etcd_down:
                _log.warning("etcd at %s does not answer (%s); retrying every %.2g s to keep "
                             "%s registered", self.discovery.etcd, type(exc).__name__,
                             self.beat_seconds, self.key)
            self._etcd_down = True
            return
        except Exception as exc:       # an etcd error, or a reply this cannot read
            if self._refusal != type(exc).__name__:
                _log.warning("etcd at %s refused a request for %s (%s: %s); registering again "
                             "with a fresh lease", self.discovery.etcd, self.key,
                             type(exc).__name__, exc)
            self._refusal = type(exc).__name__
            self._lease = self._published = None
            return
        self._refusal = None
        if self._etcd_down:
            _log.warning("etcd at %s answers again; %s is registered", self.discovery.etcd,
                         self.key)
        self._etcd_down = False

    def _read_load(self) -> Loads:
        if self._load is None:
            return self._last_load
        try:
            load = self._load()
        except Exception as exc:       # the server's own endpoint, e.g. restarting
            if not self._load_failing:
                _log.warning("%s: reading the load failed (%s); publishing the last one",
                             self.key, exc)
            self._load_failing = True
            return self._last_load
        self._load_failing, self._last_load = False, load
        return load
