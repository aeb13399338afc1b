"""The scheduler's view of the servers registered under a prefix, per role.

It polls one range request per role over ``{prefix}/{role}/`` every ``poll_seconds``
(0.25 s) rather than watching (etcd3gw's watch cannot report that etcd went away; see
:mod:`.etcd`). Each poll returns the whole current set (up to
:data:`MEMBERS_PER_ROLE`), so nothing needs reconciling after a gap, and a failed poll
means exactly "etcd does not answer". A server that registers is seen at
the next poll; one whose lease lapses is gone at the first poll after etcd deletes its
key (etcd sweeps expired leases every 0.5 s).

Invariants:

- :meth:`Membership.members` holds only well-formed records of that role whose engine
  fingerprint is the scheduler's own, sorted by gRPC url (a stable order to route over).
- A record with another fingerprint is refused: left out and logged at ERROR, once per
  key and fingerprint. A record that does not parse (whatever the parser raises: deep
  nesting, a huge value, a load over its own capacity; see :mod:`.record`), or does not
  match its key, is left out, counted in :attr:`refused` and logged once per key and
  reason; the other records of that poll are read as usual.
- What a record claims is bounded by the deployment's config: with
  ``discovery.kv_budget`` (role -> KV bytes a server of that role holds) and
  ``block_nbytes`` (the fewest bytes a KV block of ``tokens_per_block`` tokens takes in
  this engine), its ``kv_blocks_total`` and free blocks are capped at what that budget
  holds (logged once per key), so an inflated record cannot draw every least_loaded pick.
- A poll reads at most :data:`MEMBERS_PER_ROLE` (256) records per role, the first in
  key order (etcd's range ``limit``): a writer to etcd that puts 100k records under the
  prefix costs each poll 256 records per role, not 100k. The records past it are counted
  in :attr:`unread` (per role, last poll) and logged once each time a role starts
  overflowing. Such a writer can crowd real servers out of the 256, as it could delete
  their keys: etcd's auth is what keeps it out (docs/deploy.md). The limit counts
  records, not bytes: a real record is about 500 bytes (one over
  :data:`.record.MAX_RECORD_BYTES` is refused once read), but etcd takes values up to
  its ``--max-request-bytes`` (1.5 MiB by default), so such a writer can make a reply
  ~384 MiB per role (more as base64 in JSON); one that does not arrive within
  ``REQUEST_TIMEOUT`` is a poll etcd did not answer (the last set read stays). More than
  256 real servers of one role: the scheduler routes over the first 256 in key order.
- An exception out of a poll never ends polling (:class:`.periodic.Periodic`).
- While etcd does not answer (or answers what cannot be read), :meth:`members` is the
  last set read and
  :attr:`etcd_reachable` is False; one log line when etcd stops answering, one when it
  answers again.
- :attr:`on_poll`, when set before :meth:`start`, is called after every poll, answered
  or not, even one that raised, on the polling thread (the first time inside :meth:`start`).
"""

from __future__ import annotations

import logging
from typing import Callable

from triton_disagg.config.discovery_section import DiscoveryConfig
from triton_disagg.config.roles import ENGINE_ROLES

from .etcd import connect, member_key, read_prefix, role_prefix
from .periodic import Periodic
from .record import MemberRecord

_log = logging.getLogger(__name__)
POLL_SECONDS = 0.25
REQUEST_TIMEOUT = 1.0
LOGGED_MAX = 4096            # (key, problem) pairs remembered as logged
MEMBERS_PER_ROLE = 256      # records read per role and poll; more servers than this per
                            # role are not seen (module docstring)


class Membership:
    def __init__(self, discovery: DiscoveryConfig, fingerprint: str,
                 poll_seconds: float = POLL_SECONDS,
                 block_nbytes: Callable[[int], int] | None = None):
        self.discovery, self.fingerprint, self.poll_seconds = discovery, fingerprint, poll_seconds
        self.block_nbytes = block_nbytes
        self.refused = 0                # records left out because they did not parse
        self.unread = {role: 0 for role in ENGINE_ROLES}   # past MEMBERS_PER_ROLE, last poll
        self.on_poll: Callable[[Membership], None] | None = None
        self._client = connect(discovery, timeout=REQUEST_TIMEOUT)
        self._members: dict[str, tuple[MemberRecord, ...]] = {role: () for role in ENGINE_ROLES}
        self.etcd_reachable = False     # whether the last poll got an answer (metrics gauge)
        self._polled_once = False
        self._logged: set[tuple[str, str]] = set()   # (key, problem) already logged
        self._poller = Periodic(self._poll, poll_seconds, "etcd-membership")

    def members(self, role: str) -> tuple[MemberRecord, ...]:
        return self._members[role]

    def start(self) -> "Membership":
        """Read the current set now (or log that etcd does not answer) and keep polling."""
        self._poller.start()
        return self

    def close(self) -> None:
        self._poller.stop()

    def _poll(self) -> None:
        try:
            self._read()
        finally:
            if self.on_poll is not None:
                self.on_poll(self)

    def _read(self) -> None:
        try:
            ranges = {role: read_prefix(self._client, role_prefix(self.discovery.prefix, role),
                                        MEMBERS_PER_ROLE) for role in ENGINE_ROLES}
        except Exception as exc:       # down, refusing, or a reply etcd3gw cannot read
            if self.etcd_reachable or not self._polled_once:
                _log.warning("etcd at %s does not answer (%s); keeping the last known members "
                             "(%s)", self.discovery.etcd, type(exc).__name__, self._sizes())
            self.etcd_reachable, self._polled_once = False, True
            return
        found: dict[str, list[MemberRecord]] = {role: [] for role in ENGINE_ROLES}
        for role, (kvs, count) in ranges.items():
            self._count_unread(role, count - len(kvs))
            for key, value in kvs:
                record = self._accept(key, value)
                if record is not None:
                    found[record.role].append(record)
        self._members = {role: tuple(sorted(records, key=lambda r: r.grpc_url))
                         for role, records in found.items()}
        if not self.etcd_reachable and self._polled_once:
            _log.warning("etcd at %s answers again; members: %s", self.discovery.etcd,
                         self._sizes())
        self.etcd_reachable, self._polled_once = True, True

    def _count_unread(self, role: str, unread: int) -> None:
        """Note the ``unread`` records of ``role`` past the limit; logged when they start."""
        if unread > 0 and self.unread[role] == 0:
            _log.warning("etcd: %d %s records under %s, more than the %d a poll reads; "
                         "reading the first %d in key order (a writer to etcd filled it?)",
                         unread + MEMBERS_PER_ROLE, role, role_prefix(self.discovery.prefix, role),
                         MEMBERS_PER_ROLE, MEMBERS_PER_ROLE)
        self.unread[role] = max(unread, 0)

    def _accept(self, key: str, value: bytes) -> MemberRecord | None:
        """The record at ``key``, or None (logged once) when it is refused."""
        try:
            record = MemberRecord.from_json(value)
            if key != member_key(self.discovery.prefix, record.role, record.grpc_url):
                raise ValueError(f"it names {record.role} {record.grpc_url}, another key")
        except Exception as exc:       # anything etcd holds may be garbage: never end the poll
            self.refused += 1
            self._log_once(key, f"{type(exc).__name__}: {exc}"[:200], logging.WARNING,
                           "etcd: ignoring %s: %s", key[:200], f"{exc}"[:200])
            return None
        if record.fingerprint != self.fingerprint:
            self._log_once(key, record.fingerprint, logging.ERROR,
                           "REFUSED %s server %s: its engine fingerprint %s is not this "
                           "scheduler's %s; serve the same engine on both", record.role,
                           record.grpc_url, record.fingerprint[:16], self.fingerprint[:16])
            return None
        return self._bounded(key, record)

    def _bounded(self, key: str, record: MemberRecord) -> MemberRecord:
        """``record`` capped at the KV blocks its role's budget holds (module docstring)."""
        budget = self.discovery.kv_budget.get(record.role)
        if not budget or self.block_nbytes is None:
            return record
        capped = record.capped(budget // self.block_nbytes(record.tokens_per_block))
        if capped is not record:
            self._log_once(key, "capped", logging.WARNING,
                           "etcd: %s server %s claims %d KV blocks, more than this deployment's "
                           "kv_cache.max_size x instances holds; counting %d", record.role,
                           record.grpc_url, record.kv_blocks_total, capped.kv_blocks_total)
        return capped

    def _log_once(self, key: str, problem: str, level: int, message: str, *args) -> None:
        if len(self._logged) >= LOGGED_MAX:   # keys written to flood the log: start over
            self._logged.clear()
        if (key, problem) not in self._logged:
            self._logged.add((key, problem))
            _log.log(level, message, *args)

    def _sizes(self) -> str:
        return ", ".join(f"{len(self._members[role])} {role}" for role in ENGINE_ROLES)
