"""Build an engine directory from a Hugging Face checkpoint directory.

Invariants: the fingerprint is sha256 over BUILDER_VERSION, the resolved build options
and the name and bytes of every checkpoint file (``Checkpoint.files``), and nothing
else (not the checkpoint's path); an output directory is only ever replaced whole, by
renaming a finished temporary directory from the same parent into place, so a reader
sees the old engine or the new one, never half of one; ``engine.json`` is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable

from triton_disagg.builders.checkpoint import Checkpoint, load_checkpoint
from triton_disagg.builders.convert import convert_weights
from triton_disagg.engine.spec import (BUILDER_VERSION, ENGINE_JSON, STORAGE_DTYPES,
                                       TOKENIZER_FILE, WEIGHTS_FILE, EngineSpec, KVLayout)
from triton_disagg.errors import UserError

DEFAULT_MAX_SEQ_LEN = 2048
Progress = Callable[[str], None]


class BuildError(UserError):
    """A build option or output directory that cannot be used."""


def fingerprint(ckpt: Checkpoint, options: dict) -> str:
    """sha256 hex of BUILDER_VERSION, ``options`` and each checkpoint file's name and bytes."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"builder_version": BUILDER_VERSION, **options},
                             sort_keys=True).encode())
    for path in ckpt.files:
        digest.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def staging_dir(output: Path) -> Path:
    """A new empty directory beside ``output`` (same filesystem, so renames are atomic),
    with the umask's permissions (unlike ``mkdtemp``'s 0700)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.parent / f".{output.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staged.mkdir()
    return staged


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, but with the umask's file permissions (it writes 0600)."""
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, path.parent.stat().st_mode & 0o666)


def replace_dir(staged: Path, output: Path) -> None:
    """Move the finished directory ``staged`` to ``output``, replacing what was there."""
    if not output.exists():
        os.rename(staged, output)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    os.rename(output, trash / output.name)
    os.rename(staged, output)
    shutil.rmtree(trash)


def _check_options(dtype: str, kv_dtype: str, ints: dict[str, int | None]) -> None:
    for flag, value in (("dtype", dtype), ("kv-dtype", kv_dtype)):
        if value not in STORAGE_DTYPES:
            raise BuildError(f"--{flag}: must be one of {', '.join(STORAGE_DTYPES)}, "
                             f"got {value!r}")
    for flag, value in ints.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):
            raise BuildError(f"--{flag}: must be a positive integer, got {value!r}")


def _resolve_max_seq_len(ckpt: Checkpoint, max_seq_len: int | None) -> int:
    """The requested length, or min(max_position_embeddings, 2048, sliding_window)."""
    s, config = ckpt.shape, ckpt.path / "config.json"
    limits = {"max_position_embeddings": s.max_position_embeddings}
    if s.sliding_window:
        limits["sliding_window"] = s.sliding_window
    if max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, *limits.values())
    for key, limit in limits.items():
        if max_seq_len > limit:
            raise BuildError(f"--max-seq-len: {max_seq_len} exceeds {key} {limit} "
                             f"of {config}")
    return max_seq_len


def _existing(output: Path) -> EngineSpec | None:
    """The spec of the engine at ``output`` (None if absent or unreadable)."""
    if output.exists() and not output.is_dir():
        raise BuildError(f"{output}: exists and is not a directory; choose another --output")
    if not (output / ENGINE_JSON).is_file():
        if output.is_dir() and any(output.iterdir()):
            raise BuildError(f"{output}: not empty and not an engine directory; refusing to "
                             f"overwrite it, choose another --output")
        return None
    try:
        return EngineSpec.from_json((output / ENGINE_JSON).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def build_engine(checkpoint: str | Path, output: str | Path, dtype: str = "float32",
                 tokens_per_block: int = 16, max_batch_size: int = 32,
                 max_seq_len: int | None = None, kv_dtype: str = "float32",
                 force: bool = False, progress: Progress | None = None
                 ) -> tuple[EngineSpec, bool]:
    """Convert ``checkpoint`` into the engine directory ``output``.

    Returns ``(spec, built)``; ``built`` is False when ``output`` already held an engine
    with the same fingerprint (and weights) and ``force`` was not set. ``progress``
    (print-like, e.g. to stderr) gets human-readable lines; None keeps it quiet.
    """
    say = progress or (lambda _line: None)
    _check_options(dtype, kv_dtype, {"tokens-per-block": tokens_per_block,
                                     "max-batch-size": max_batch_size,
                                     "max-seq-len": max_seq_len})
    checkpoint, output = Path(checkpoint), Path(output)
    ckpt = load_checkpoint(checkpoint)
    options = {"dtype": dtype, "tokens_per_block": tokens_per_block, "kv_dtype": kv_dtype,
               "max_batch_size": max_batch_size,
               "max_seq_len": _resolve_max_seq_len(ckpt, max_seq_len)}
    fp = fingerprint(ckpt, options)
    old = _existing(output)
    if old is not None and old.fingerprint == fp and (output / WEIGHTS_FILE).is_file() \
            and not force:
        say(f"engine at {output} is up to date (fingerprint {fp[:12]}); use --force to rebuild")
        return old, False
    spec = EngineSpec(
        shape=ckpt.shape, kv=KVLayout(tokens_per_block=tokens_per_block, dtype=kv_dtype),
        dtype=dtype, max_batch_size=max_batch_size, max_seq_len=options["max_seq_len"],
        bos_token_id=ckpt.bos_token_id, eos_token_id=ckpt.eos_token_id,
        pad_token_id=ckpt.pad_token_id, fingerprint=fp,
        source={"checkpoint": str(checkpoint.resolve()), "options": options})
    say(f"building {ckpt.shape.architecture} engine ({ckpt.shape.num_layers} layers, {dtype}) "
        f"from {checkpoint}")
    staged = staging_dir(output)
    try:
        _write(ckpt, spec, staged, say)
        replace_dir(staged, output)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    say(f"engine written to {output} (fingerprint {fp[:12]})")
    return spec, True


def _write(ckpt: Checkpoint, spec: EngineSpec, staged: Path, say: Progress) -> None:
    weights = convert_weights(ckpt, spec.dtype, say)
    save_safetensors(weights, staged / WEIGHTS_FILE, {"fingerprint": spec.fingerprint})
    for name in (TOKENIZER_FILE, "tokenizer_config.json"):
        if (ckpt.path / name).is_file():
            shutil.copyfile(ckpt.path / name, staged / name)
    (staged / ENGINE_JSON).write_text(spec.to_json() + "\n")
