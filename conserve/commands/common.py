"""Options shared by several commands (``--threads``, ``--device``); importing this module does not import torch."""
from __future__ import annotations

from ..errors import UsageError


def add_threads_argument(group) -> None:
    group.add_argument("--threads", type=int, default=1,
                       help="torch intra-op threads on CPU (default 1: small models gain nothing from more and contend "
                            "with other processes; 0 keeps torch's default)")


def add_device_argument(group) -> None:
    group.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default auto: cuda when available)")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is available else ``cpu``; anything else is checked (``UsageError``)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown --device {device!r}; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no GPU is available; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not supported; use cpu or cuda[:N]")
    return device


class torch_threads:
    """Context manager: ``torch.set_num_threads(n)`` inside (n >= 1), the previous value restored after."""

    def __init__(self, n: int):
        if n < 0:
            raise UsageError(f"--threads must be >= 0, got {n}")
        self.n = n

    def __enter__(self):
        import torch

        self.prev = torch.get_num_threads()
        if self.n:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *a):
        import torch

        torch.set_num_threads(self.prev)
        return False
