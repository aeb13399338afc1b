"""The config's ``front`` section: the HTTP front's admission limits and timeouts, its
dataclass, its parser, and the command-line flags that carry it to the front's process
(:mod:`triton_disagg.front.http_front`, started by :mod:`launch.front_process`).

::

    front:
      max_concurrent_requests: 64    # generation requests in flight; past it: 429 + Retry-After
      max_connections: 512           # open connections; past it: 503 + Retry-After, closed
      idle_timeout_seconds: 30       # request headers must arrive within (and keep-alive idle)
      body_timeout_seconds: 30       # a request's body must arrive within (else 408)
      write_timeout_seconds: 30      # what is written must be taken by the client within it
      allowed_origins: []            # browser origins let through, e.g. ["https://ui.example"]
      allowed_hosts: []              # Host names accepted besides loopback ones

Invariant: a :class:`FrontConfig` the parser returns has whole-number caps >= 1, finite
timeouts > 0 and origin/host strings; :func:`front_flags` and :func:`front_from_flags`
round-trip it exactly.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any
# Any here: parsed YAML values, checked where they are read.

from triton_disagg.config.values import count, mapping, number
from triton_disagg.errors import UserError


@dataclass(frozen=True)
class FrontConfig:
    """What the HTTP front admits and for how long it waits (module docstring)."""

    max_concurrent_requests: int = 64
    max_connections: int = 512
    idle_timeout_seconds: float = 30.0
    body_timeout_seconds: float = 30.0
    write_timeout_seconds: float = 30.0
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()


_CAPS = ("max_concurrent_requests", "max_connections")
_TIMEOUTS = ("idle_timeout_seconds", "body_timeout_seconds", "write_timeout_seconds")
_LISTS = ("allowed_origins", "allowed_hosts")


def parse_front(raw: Any) -> FrontConfig:
    """The ``front`` mapping (absent: the defaults) checked into a :class:`FrontConfig`."""
    s = mapping(raw, "front", {f.name for f in fields(FrontConfig)})
    values: dict[str, Any] = {}
    for key in _CAPS:
        if key in s:
            values[key] = count(s[key], f"front.{key}")
    for key in _TIMEOUTS:
        if key in s:
            values[key] = number(s[key], f"front.{key}")
    for key in _LISTS:
        if key in s:
            items = s[key]
            if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
                raise UserError(f"front.{key}: {items!r} must be a list of strings, e.g. "
                                f"[\"https://ui.example.com\"]")
            values[key] = tuple(items)
    return FrontConfig(**values)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def front_flags(config: FrontConfig) -> list[str]:
    """``config`` as the front process's command-line flags."""
    argv: list[str] = []
    for f in fields(FrontConfig):
        value = getattr(config, f.name)
        if f.name in _LISTS:
            argv += [_flag(f.name), ",".join(value)]
        else:
            argv += [_flag(f.name), str(value)]
    return argv


def add_front_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of :func:`front_flags`, each defaulting to :class:`FrontConfig`'s value."""
    defaults = FrontConfig()
    for f in fields(FrontConfig):
        default = getattr(defaults, f.name)
        kind = int if f.name in _CAPS else float if f.name in _TIMEOUTS else str
        parser.add_argument(_flag(f.name), type=kind,
                            default=",".join(default) if f.name in _LISTS else default,
                            help=f"front.{f.name} (default {default!r})")


def front_from_flags(args: argparse.Namespace) -> FrontConfig:
    """The parsed flags of :func:`add_front_flags` -> a checked :class:`FrontConfig`."""
    raw = {f.name: getattr(args, f.name) for f in fields(FrontConfig)}
    for key in _LISTS:
        raw[key] = [item for item in raw[key].split(",") if item]
    return parse_front(raw)
