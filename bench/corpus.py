"""An offline byte-level text corpus: the Python standard library's own source.

Every host that runs Python has it, so training needs no network and no data set.
Tokens are bytes (ids 0..255). The corpus is the stdlib's ``*.py`` files in sorted path
order (site-packages excluded: it differs between hosts), concatenated, capped at
``max_bytes``; the last ``val_fraction`` of it is held out for validation. Different
Python versions ship different sources, so the description carries a hash of the bytes.

    PYTHONPATH=. python -m bench.corpus      # prints the description and a sample batch
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class Corpus(NamedTuple):
  train: np.ndarray  # uint8
  val: np.ndarray  # uint8, the held-out tail
  n_files: int
  root: Path
  sha256: str  # of train + val, to tell corpora of different Python versions apart

  def describe(self) -> str:
    mib = lambda a: f"{a.size / 2**20:.2f} MiB"
    return (f"corpus: {self.n_files} .py files of the Python stdlib at {self.root}, "
            f"{mib(self.train)} train + {mib(self.val)} validation bytes, "
            f"sha256 {self.sha256[:12]}")


def source_files(root: Path) -> list[Path]:
  return sorted(p for p in root.rglob("*.py")
                if not SKIP_DIRS.intersection(p.relative_to(root).parts) and p.is_file())


def load(batch: int, seq: int, max_bytes: int = 64 << 20, val_fraction: float = 0.01,
         root: str | Path | None = None) -> Corpus:
  """Reads the corpus; ``batch`` and ``seq`` size the checks: each split must hold one
  batch of non-overlapping ``seq + 1``-byte windows (tokens and next-byte targets)."""
  root = Path(root or sysconfig.get_paths()["stdlib"])
  chunks, total, n_files = [], 0, 0
  for path in source_files(root):
    if total >= max_bytes:
      break
    try:
      data = path.read_bytes()
    except OSError:  # unreadable (permissions, a dangling link): not worth failing over
      continue
    chunks.append(data[:max_bytes - total])
    total += len(chunks[-1])
    n_files += 1
  data = np.frombuffer(b"".join(chunks), np.uint8)
  need = batch * (seq + 1)
  n_val = max(int(data.size * val_fraction), need)
  if data.size - n_val < need:
    raise ValueError(f"corpus too small: {data.size} bytes from {n_files} files under "
                     f"{root}; one batch needs {need} bytes (batch {batch} x (seq {seq} + 1)) "
                     f"for training and as many for validation. Lower --batch or --seq.")
  return Corpus(data[:-n_val], data[-n_val:], n_files, root,
                hashlib.sha256(data.tobytes()).hexdigest())


def batches(data: np.ndarray, batch: int, seq: int, seed: int
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless (tokens, targets), each (batch, seq) int32, targets the next byte: windows
  at uniformly random offsets drawn by ``np.random.default_rng(seed)``, so the same seed
  gives the same sequence of batches."""
  rng = np.random.default_rng(seed)
  window = np.arange(seq + 1)
  while True:
    starts = rng.integers(0, data.size - seq, size=batch)  # exclusive: start + seq < size
    chunk = data[starts[:, None] + window].astype(np.int32)
    yield chunk[:, :-1], chunk[:, 1:]


if __name__ == "__main__":
  c = load(batch=2, seq=64)
  print(c.describe())
  tokens, targets = next(batches(c.train, 2, 64, seed=0))
  print(tokens.shape, tokens.dtype, repr(bytes(tokens[0].astype(np.uint8))))
