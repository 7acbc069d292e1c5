"""Image data sets from local files: MNIST (IDX format, ``.gz`` or plain) and CIFAR-10 (binary version).

Nothing is downloaded: point the loaders at the files. Every problem with a file (missing, unreadable,
truncated, wrong magic number, inconsistent sizes, bad labels) raises ``conserve.errors.UsageError`` with
one line that names the file and the fix.

Formats
- IDX (LeCun et al., http://yann.lecun.com/exdb/mnist/): bytes 0-1 zero, byte 2 the element type
  (0x08 unsigned byte, 0x09 signed byte, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64), byte 3
  the number of dimensions, then one big-endian uint32 per dimension, then the data (big-endian, row-major).
  MNIST: images magic 2051 (ubyte, 3 dims, N x 28 x 28), labels magic 2049 (ubyte, 1 dim, N).
- CIFAR-10 binary (Krizhevsky 2009, https://www.cs.toronto.edu/~kriz/cifar.html): records of 3073 bytes,
  one label byte (0-9) then 1024 red, 1024 green, 1024 blue bytes, each a 32 x 32 row-major plane.

Gzip is recognised by its magic bytes (1f 8b), not by the file name.
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import torch

from .errors import UsageError

__all__ = [
    "read_idx",
    "load_mnist",
    "load_cifar10",
    "MNIST_MEAN",
    "MNIST_STD",
    "CIFAR10_CLASSES",
]

MNIST_MEAN = 0.1307  # mean pixel of the MNIST training images, pixels scaled to [0, 1]
MNIST_STD = 0.3081
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CIFAR_RECORD = 1 + 3 * 32 * 32


def _read_bytes(path: Path, what: str) -> bytes:
    """Whole file contents, gunzipped when the file starts with the gzip magic bytes."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{what} not found: {path}; check the path (nothing is downloaded)")
    if not path.is_file():
        raise UsageError(f"{what} is not a file: {path}; pass the file itself")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror}; check its permissions") from e
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise UsageError(f"{what} {path} is a corrupt or truncated gzip file ({e}); download it again") from e
    return raw


def read_idx(path: str | Path, *, what: str = "IDX file") -> np.ndarray:
    """Read an IDX file (``.gz`` or plain) into a numpy array in native byte order.

    Returns an array of the file's element type (uint8 for MNIST) and shape (its dims).
    Raises ``UsageError`` if the file is missing, not IDX, or its payload length does not match its header.
    """
    path = Path(path)
    data = _read_bytes(path, what)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise UsageError(f"{what} {path} is not an IDX file (bad magic number); pass an MNIST-style idx file")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise UsageError(f"{what} {path}: unknown IDX element type 0x{code:02x}; the file is corrupt")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise UsageError(f"{what} {path} is truncated inside its header; download it again")
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_DTYPES[code]
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise UsageError(
            f"{what} {path}: header says shape {dims} ({expected} bytes) but the file holds {len(data)} bytes;"
            " the file is truncated or corrupt, download it again"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _find(root: Path, names: list[str]) -> Path | None:
    for name in names:
        for cand in (root / name, root / (name + ".gz")):
            if cand.is_file():
                return cand
    return None


def load_mnist(root: str | Path, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST images and labels from a directory of IDX files (``.gz`` or plain).

    Looks for ``{train,t10k}-images-idx3-ubyte[.gz]`` and ``{train,t10k}-labels-idx1-ubyte[.gz]`` (also the
    ``-images.idx3-ubyte`` spelling). ``split`` is ``"train"`` (60,000) or ``"test"`` (10,000).

    Returns ``(images, labels)``: uint8 tensor ``(N, 28, 28)`` (0-255) and int64 tensor ``(N,)`` (0-9).
    Raises ``UsageError`` for a missing directory or file, a corrupt file, a count mismatch or bad labels.
    """
    if split not in ("train", "test"):
        raise UsageError(f"MNIST split must be 'train' or 'test', not {split!r}")
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"MNIST directory not found: {root}; pass the directory holding the idx files")
    prefix = "train" if split == "train" else "t10k"
    img_names = [f"{prefix}-images-idx3-ubyte", f"{prefix}-images.idx3-ubyte"]
    lab_names = [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels.idx1-ubyte"]
    img_path, lab_path = _find(root, img_names), _find(root, lab_names)
    for p, names in ((img_path, img_names), (lab_path, lab_names)):
        if p is None:
            raise UsageError(f"MNIST {split} file {names[0]}[.gz] not found in {root}; put the idx files there")
    images = read_idx(img_path, what="MNIST images")
    labels = read_idx(lab_path, what="MNIST labels")
    if images.dtype != np.uint8 or images.ndim != 3:
        raise UsageError(f"MNIST images {img_path}: expected uint8 N x H x W, got {images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise UsageError(f"MNIST labels {lab_path}: expected uint8 N, got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise UsageError(
            f"MNIST {split}: {len(images)} images but {len(labels)} labels; the files do not belong together"
        )
    if labels.size and labels.max() > 9:
        raise UsageError(f"MNIST labels {lab_path}: label {int(labels.max())} out of range 0-9; the file is corrupt")
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def _cifar_files(path: Path, split: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.exists():
        raise UsageError(f"CIFAR-10 path not found: {path}; pass a .bin[.gz] file or the cifar-10-batches-bin directory")
    roots = [path, path / "cifar-10-batches-bin"]
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if split == "train" else ["test_batch.bin"]
    for root in roots:
        found = [_find(root, [n]) for n in names]
        if any(found):
            missing = [n for n, f in zip(names, found) if f is None]
            if missing:
                raise UsageError(f"CIFAR-10 {split} files missing in {root}: {', '.join(missing)}; restore them")
            return [f for f in found if f is not None]
    raise UsageError(
        f"no CIFAR-10 {split} batches ({names[0]}[.gz] ...) in {path}; pass the .bin file itself or its directory"
    )


def load_cifar10(path: str | Path, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 images and labels from the binary version (records of 1 label byte + 3072 pixel bytes).

    ``path`` is one ``.bin`` file (``.gz`` allowed; ``split`` is then ignored) or a directory holding
    ``data_batch_1..5.bin`` (train) / ``test_batch.bin`` (test), directly or in ``cifar-10-batches-bin/``.

    Returns ``(images, labels)``: uint8 tensor ``(N, 3, 32, 32)`` (channels R, G, B; 0-255) and int64
    tensor ``(N,)`` (0-9, names in ``CIFAR10_CLASSES``).
    Raises ``UsageError`` for missing files, a size that is not a whole number of records, or a label > 9.
    """
    if split not in ("train", "test"):
        raise UsageError(f"CIFAR-10 split must be 'train' or 'test', not {split!r}")
    images, labels = [], []
    for f in _cifar_files(Path(path), split):
        data = _read_bytes(f, "CIFAR-10 file")
        if len(data) == 0 or len(data) % _CIFAR_RECORD:
            raise UsageError(
                f"CIFAR-10 file {f}: {len(data)} bytes is not a whole number of {_CIFAR_RECORD}-byte records;"
                " the file is truncated or not the binary version (the python pickles are not supported)"
            )
        rec = np.frombuffer(data, dtype=np.uint8).reshape(-1, _CIFAR_RECORD)
        lab = rec[:, 0].astype(np.int64)
        if lab.max() > 9:
            raise UsageError(f"CIFAR-10 file {f}: label {int(lab.max())} out of range 0-9; the file is corrupt"
                             " or is CIFAR-100 (2 label bytes per record), which is not supported")
        images.append(rec[:, 1:].reshape(-1, 3, 32, 32).copy())
        labels.append(lab)
    return torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels))
