"""Text corpora as byte-level token streams, and the batches ``conserve run`` trains on.

Default corpus (no network needed): the English help text that ships inside CPython's standard library
(``pydoc_data.topics``, about 0.5 MB). ``--data PATH`` takes the user's text: a file (plain or ``.gz``) or a
directory holding a PTB (``ptb.train.txt``) or WikiText (``wiki.train.tokens``) training split.
Tokens are UTF-8 bytes (vocabulary 256).
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import torch

from .errors import UsageError

VOCAB_SIZE = 256
TRAIN_NAMES = ("ptb.train.txt", "wiki.train.tokens", "train.txt", "input.txt")


def embedded_corpus() -> str:
    """CPython's pydoc topics (English documentation text), joined in sorted-key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - some distributions split pydoc_data out
        raise UsageError("the embedded corpus (CPython's pydoc_data) is missing from this Python; "
                         "pass --data PATH to a text file") from None
    return "\n\n".join(topics[k] for k in sorted(topics))


def _resolve(path: Path) -> Path:
    if path.is_dir():
        for name in TRAIN_NAMES:
            for cand in (path / name, path / f"{name}.gz"):
                if cand.is_file():
                    return cand
        raise UsageError(f"{path} is a directory without a training split ({', '.join(TRAIN_NAMES)}, plain or .gz); "
                         "pass --data PATH to the text file itself")
    if not path.exists():
        raise UsageError(f"data file {path} not found; pass --data PATH to an existing text file (plain or .gz)")
    return path


def read_text(path: str | Path) -> str:
    """The text of a plain or gzip file. Raises ``UsageError`` for a missing, empty or binary file."""
    p = _resolve(Path(path).expanduser())
    try:
        raw = p.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise UsageError(f"cannot read {p}: {e}; pass --data PATH to a readable text file (plain or .gz)") from None
    if not raw.strip():
        raise UsageError(f"data file {p} is empty; pass --data PATH to a file with text in it")
    sample = raw[:65536]
    if b"\x00" in sample:
        raise UsageError(f"data file {p} looks binary (NUL bytes); pass a UTF-8 text file (plain or .gz)")
    text = raw.decode("utf-8", errors="replace")
    if text[:65536].count("\ufffd") > 0.01 * min(len(text), 65536):
        raise UsageError(f"data file {p} is not UTF-8 text; pass a UTF-8 text file (plain or .gz)")
    return text


def load_tokens(path: str | Path | None = None) -> tuple[torch.Tensor, str]:
    """Byte tokens (int64, 1-D) and a description of the source (the embedded corpus when ``path`` is None)."""
    if path is None:
        text, source = embedded_corpus(), "embedded: CPython pydoc_data.topics"
    else:
        text, source = read_text(path), str(_resolve(Path(path).expanduser()))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long(), source


class Batches:
    """Random windows of ``seq_len + 1`` tokens: ``(inputs, targets)`` int64 ``(batch_size, seq_len)``.

    ``fixed=True`` draws one batch and returns it every time (full-batch gradient descent on that
    fixed set). Deterministic for a given ``seed``; its position is in ``state_dict``."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, *, seed: int = 0, fixed: bool = False):
        if tokens.numel() < seq_len + 2:
            n = tokens.numel()
            raise UsageError(f"the corpus has {n} token{'' if n == 1 else 's'}, fewer than --seq-len {seq_len} + 2; "
                             "use a longer text or a shorter --seq-len")
        self.tokens, self.batch_size, self.seq_len, self.fixed = tokens, batch_size, seq_len, fixed
        self.gen = torch.Generator().manual_seed(seed)
        self._fixed = self._draw() if fixed else None

    def _draw(self):
        start = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        idx = start[:, None] + torch.arange(self.seq_len + 1)
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:]

    def __iter__(self):
        return self

    def __next__(self):
        return self._fixed if self.fixed else self._draw()

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, s: dict) -> None:
        self.gen.set_state(s["gen"])
