"""The deployment's two vocabularies: its mode and the roles a server plays.

Text from the YAML config (``mode:``), the CLI (``serve ROLE``), etcd records and
``settings.json`` becomes a :class:`Mode` or :class:`Role` where it is parsed (in
:mod:`triton_disagg.config`, :mod:`triton_disagg.routing.discovery.record` and
``launch``); code past that point compares members, never strings (a unit test keeps
``mode == "..."`` / ``role == "..."`` out of the rest of the package).

Invariant: both are :class:`~enum.StrEnum`, so a member *is* its text: it goes into JSON,
etcd keys, metric labels and messages unchanged, and ``Role("context")`` parses it back.
"""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """``mode:`` of the config: whether a prompt's prefill runs on a context server and its
    KV moves to generation (disaggregated), or generation serves the request whole."""

    DISAGGREGATED = "disaggregated"
    AGGREGATED = "aggregated"


class Role(StrEnum):
    """What one server (``serve ROLE``) runs: a context or generation engine, the
    scheduler (the front end: HTTP, preprocessing, the orchestrator), or all three."""

    CONTEXT = "context"
    GENERATION = "generation"
    SCHEDULER = "scheduler"
    ALL = "all"


ENGINE_ROLES = (Role.CONTEXT, Role.GENERATION)      # the roles that run the model, hold KV
PLACED_ROLES = (*ENGINE_ROLES, Role.SCHEDULER)      # the roles a config section places
SERVE_ROLES = (Role.ALL, *PLACED_ROLES)             # what ``serve`` takes


def engine_roles(mode: Mode) -> tuple[Role, ...]:
    """The engine models a deployment of ``mode`` runs: generation alone when aggregated."""
    return (Role.GENERATION,) if mode == Mode.AGGREGATED else ENGINE_ROLES


def instance_models(role: Role, instances: int) -> tuple[str, ...]:
    """The Triton models that serve ``role``'s ``instances`` model instances, each reachable
    on its own. Context renders one model per instance, ``context`` for instance 0 (what a
    one-instance server has always been called) and ``context_<i>`` for instance i, so a
    router's choice of instance (the one whose prefix cache holds a prompt) is the model it
    calls: Triton has no per-instance addressing. Generation is one model of ``instances``
    instances (its routing is by load; its instances share the server's token path)."""
    if role != Role.CONTEXT:
        return (role.value,)
    return tuple(role.value if i == 0 else f"{role.value}_{i}" for i in range(instances))
