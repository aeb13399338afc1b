"""One value of ``disagg_config.yaml``, checked: sizes, urls, lists of indices, counts,
seconds and mappings of known keys. Each mistake is one :class:`UserError` line naming the
key (the caller passes its dotted name) and the fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
# Any here: parsed YAML values, checked where they are read.

from triton_disagg.errors import UserError

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: Any, key: str) -> int:
    """``2GB`` / ``512MiB`` / ``1000000`` -> bytes (> 0)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = m.group(2).upper() if m else None
        if unit is None or unit not in _SIZE_UNITS:
            raise UserError(f"{key}: {value!r} is not a size; write e.g. 2GB, 512MiB or a byte count")
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise UserError(f"{key}: {value!r} must be more than 0 bytes; write e.g. 2GB")
    return size


def parse_url(raw: Any, key: str, example: str = "localhost:8001") -> str:
    """``host:port`` (a ``grpc://`` or ``http://`` in front is dropped), checked."""
    url = str(raw).removeprefix("grpc://").removeprefix("http://")
    host, _, port = url.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{key}: {raw!r} is not host:port; write e.g. \"{example}\"")
    return url


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1: this host, whichever host reads the name."""
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def mapping(raw: Any, key: str, allowed: set[str], required: bool = False,
            like: str | None = None) -> dict:
    """``raw`` checked as a mapping of ``allowed`` keys; ``like`` is the example its error
    shows (default: the first allowed key)."""
    if raw is None and not required:
        return {}
    if not isinstance(raw, dict):
        example = like or f"{sorted(allowed)[0]}: ..."
        raise UserError(f"{key}: expected a mapping like `{{{example}}}`, got {raw!r}")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise UserError(f"{key}: unknown key {unknown[0]!r}; allowed keys: {', '.join(sorted(allowed))}")
    return raw


def int_list(raw: Any, key: str) -> tuple[int, ...]:
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                            and v >= 0 for v in raw):
        raise UserError(f"{key}: {raw!r} must be a list of indices, e.g. [0, 1]")
    if len(set(raw)) != len(raw):
        raise UserError(f"{key}: {raw!r} lists an index twice; list each once")
    return tuple(raw)


def count(raw: Any, key: str, hint: str = "") -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise UserError(f"{key}: {raw!r} must be a whole number >= 1{hint}")
    return raw


def fraction(raw: Any, key: str) -> float:
    """A number in ``(0, 1]``."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw <= 1:
        raise UserError(f"{key}: {raw!r} must be a number > 0 and <= 1, e.g. 0.9")
    return float(raw)


def number(raw: Any, key: str) -> float:
    """A finite number of seconds > 0 (YAML's ``.nan`` and ``.inf`` are refused)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < float("inf"):
        raise UserError(f"{key}: {raw!r} must be a finite number of seconds > 0, e.g. 30")
    return float(raw)


def pem_file(raw: Any, key: str, base_dir: Path, files_here: bool) -> str:
    """A PEM file's path, absolute (a relative one resolves against ``base_dir``, the
    config's folder); ``files_here``: it must exist on this host."""
    if not isinstance(raw, str) or not raw:
        raise UserError(f"{key}: {raw!r} must be a file path (PEM)")
    path = (base_dir / raw).resolve()
    if files_here and not path.is_file():
        raise UserError(f"{key}: {path} not found; give the PEM file's path")
    return str(path)
