"""Shared pieces of ``conserve experiment scaling`` and ``conserve experiment optimizers``.

- the two models: a small Qwen-3-like decoder (RoPE, GQA, SwiGLU, a softmax-routed MoE layer, RMSNorm;
  ``conserve.models.DecoderLM``) on byte tokens of a text corpus, and a small pre-LN ViT
  (``conserve.models.ViT``) on images;
- image data: MNIST idx files or CIFAR-10 binary files from a path (``conserve.images``), or
  scikit-learn's digits when scikit-learn is installed and no path is given;
- least-squares power-law fits on logs (``fit_power``, ``fit_pooled``);
- per-family norms of any law-valued quantity of a ``Tracker`` (``family_norms``).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import UsageError

MODELS = ("lm", "vit")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


# ------------------------------------------------------------------------------------------- parsing
def float_list(s: str) -> tuple[float, ...]:
    """``"0.01,0.02"`` -> ``(0.01, 0.02)``. The parsers here raise ``argparse.ArgumentTypeError`` (argparse
    prints it as one line naming the option, exit 2)."""
    try:
        out = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0.01,0.02,0.04, got {s!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {s!r}")
    return out


def name_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(s: str) -> tuple[str, ...]:
        out = tuple(x.strip() for x in s.split(",") if x.strip())
        bad = [x for x in out if x not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}, got {s!r}")
        return tuple(dict.fromkeys(out))
    return parse


def int_pair(s: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two comma-separated steps LO,HI like 1,100, got {s!r}") from None
    if not 1 <= lo < hi:
        raise argparse.ArgumentTypeError(f"the step range LO,HI needs 1 <= LO < HI, got {s!r}")
    return lo, hi




def log_steps(steps: int, per_decade: int = 12) -> list[int]:
    """Steps 1..``steps`` spaced evenly in log k (always including 1, 10, 100, ... and ``steps``)."""
    n = max(2, int(math.ceil(per_decade * math.log10(max(steps, 2)))) + 1)
    ks = set(np.unique(np.round(np.logspace(0, math.log10(steps), n)).astype(int)).tolist())
    ks |= {10 ** i for i in range(int(math.log10(steps)) + 1)} | {steps}
    return sorted(k for k in ks if 1 <= k <= steps)


# -------------------------------------------------------------------------------------------- models
def lm_config(hidden_size: int = 32, intermediate_size: int = 64):
    """The experiments' Qwen-3-like decoder: 2 layers, 4 query heads / 2 kv heads (GQA), RoPE ('half'),
    SwiGLU; layer 1 is a NoPE layer (so QK Gram laws appear too) whose MLP is a softmax-routed MoE with
    4 SwiGLU experts, top-2. Byte vocabulary (256), untied lm_head. Law families: rope_pair, qk, vo,
    swiglu, router_sum, gain, translation."""
    from ..models import LMConfig

    return LMConfig(vocab_size=256, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=intermediate_size, max_position_embeddings=512,
                    position="rope", nope_layers=(1,), hidden_act="swiglu", num_experts=4, top_k=2, moe_layers=(1,))


def vit_config(images: torch.Tensor, num_classes: int, hidden_size: int = 32):
    """A ViT for ``images`` (N, C, S, S): 16 patches (patch S/4), 2 pre-LN layers, 4 heads, ReLU MLP (so the
    ReLU unit-balance laws appear besides the head Grams, gains and the classifier translation law)."""
    from ..models import ViTConfig

    s, c = images.shape[-1], images.shape[1]
    patch = s // 4 if s % 4 == 0 else s
    return ViTConfig(image_size=s, patch_size=patch, num_channels=c, num_classes=num_classes, hidden_size=hidden_size,
                     num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * hidden_size, hidden_act="relu")


# ---------------------------------------------------------------------------------------------- images
def load_images(path: str | Path | None, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Images as float (N, C, S, S), standardised per channel, labels int64 (N,), and the source.

    ``path``: a directory of MNIST idx files (``train-images-idx3-ubyte[.gz]`` ...), one of those files, or
    CIFAR-10 binary data (a ``.bin[.gz]`` file or its directory). ``None``: scikit-learn's 8x8 digits
    (1,797 images) when scikit-learn is installed. ``limit`` keeps the first ``limit`` images.
    Raises ``UsageError`` (names the fix) when nothing usable is found."""
    from ..images import load_cifar10, load_mnist

    if path is None:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise UsageError("the ViT needs images: pass --images PATH (an MNIST idx directory or CIFAR-10 .bin "
                             "file), install scikit-learn for its embedded 8x8 digits, or run --models lm") from None
        d = load_digits()
        x = torch.as_tensor(np.asarray(d.images), dtype=torch.float64)[:, None]  # (N, 1, 8, 8), values 0..16
        y = torch.as_tensor(np.asarray(d.target), dtype=torch.long)
        source = "embedded: scikit-learn digits (8x8)"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise UsageError(f"--images path not found: {p}; pass an MNIST idx directory or a CIFAR-10 .bin[.gz] "
                             "file or directory")
        if p.is_file() and "idx" in p.name:
            p = p.parent
        mnist = p.is_dir() and any(p.glob("*-images*idx3-ubyte*"))
        x, y = load_mnist(p) if mnist else load_cifar10(p)
        if x.ndim == 3:
            x = x[:, None]
        x = x.double()
        source = f"{'MNIST' if mnist else 'CIFAR-10'}: {p}"
    if limit is not None:
        x, y = x[:limit], y[:limit]
    if len(x) < 2:
        raise UsageError(f"{source} holds {len(x)} image(s); pass a data set with more images")
    mean = x.mean((0, 2, 3), keepdim=True)
    std = x.std((0, 2, 3), keepdim=True).clamp_min(1e-8)
    return ((x - mean) / std).float(), y, source


class ImageBatches:
    """Random minibatches ``(images, labels)`` of ``batch_size`` drawn without replacement per draw;
    ``fixed=True`` returns the first ``batch_size`` images every time (full-batch GD on that set)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, seed: int = 0,
                 fixed: bool = False):
        if batch_size > len(images):
            raise UsageError(f"batch size {batch_size} exceeds the {len(images)} images; lower --batch-size")
        self.images, self.labels, self.batch_size, self.fixed = images, labels, batch_size, fixed
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self):
        if self.fixed:
            return self.images[: self.batch_size], self.labels[: self.batch_size]
        idx = torch.randperm(len(self.images), generator=self.gen)[: self.batch_size]
        return self.images[idx], self.labels[idx]


@dataclass
class Task:
    """A model family of an experiment: how to build the model and its batches, and the loss."""

    name: str
    source: str
    build: Callable[[], torch.nn.Module]
    batches: Callable[..., object]  # (fixed, seed, size=None) -> iterator of (inputs, targets); size: batch size
    loss_fn: Callable
    config: dict


def make_tasks(models: Sequence[str], *, data, images, batch_size: int, seq_len: int, image_batch: int,
               image_limit: int, hidden_size: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> list[Task]:
    """The ``Task`` of each requested model ('lm', 'vit'), data loaded once."""
    from ..data import Batches, load_tokens
    from ..models import DecoderLM, ViT
    from ..train import classifier_loss, lm_loss

    tasks = []
    if "lm" in models:
        tokens, source = load_tokens(data)
        cfg = lm_config(hidden_size, 2 * hidden_size)

        def build_lm(cfg=cfg):
            torch.manual_seed(seed)
            return DecoderLM(cfg).to(device=device, dtype=dtype)

        tasks.append(Task("lm", source, build_lm, lambda fixed, s, n=None: Batches(tokens, n or batch_size, seq_len, seed=s, fixed=fixed),
                          lm_loss, {"model": cfg.to_dict(), "batch_size": batch_size, "seq_len": seq_len,
                                    "tokens": int(tokens.numel())}))
    if "vit" in models:
        x, y, source = load_images(images, image_limit)
        x = x.to(dtype)
        vcfg = vit_config(x, int(y.max()) + 1, hidden_size)

        def build_vit(cfg=vcfg):
            torch.manual_seed(seed)
            return ViT(cfg).to(device=device, dtype=dtype)

        tasks.append(Task("vit", source, build_vit, lambda fixed, s, n=None: ImageBatches(x, y, n or image_batch, seed=s, fixed=fixed),
                          classifier_loss, {"model": vcfg.to_dict(), "batch_size": image_batch, "images": len(x)}))
    return tasks


# ------------------------------------------------------------------------------------------------ fits
def fit_power(x: Sequence[float], y: Sequence[float]) -> dict:
    """Least squares ``log y = a log x + b``: ``{"exponent": a, "prefactor": e^b, "r2", "n"}`` over the
    points with finite positive x and y (exponent NaN with fewer than 2 such points or one x value)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    lx, ly = np.log(x[ok]), np.log(y[ok])
    if ok.sum() < 2 or np.ptp(lx) == 0:
        return {"exponent": math.nan, "prefactor": math.nan, "r2": math.nan, "n": int(ok.sum())}
    a, b = np.polyfit(lx, ly, 1)
    res = ly - (a * lx + b)
    tot = ((ly - ly.mean()) ** 2).sum()
    return {"exponent": float(a), "prefactor": float(math.exp(b)),
            "r2": float(1 - (res ** 2).sum() / tot) if tot > 0 else 1.0, "n": int(ok.sum())}


def fit_pooled(series: Sequence[tuple[Sequence[float], Sequence[float]]]) -> dict:
    """One common exponent over several (x, y) series, each with its own prefactor (least squares on
    logs with a per-series intercept): ``{"exponent", "n", "series"}``."""
    xs, ys = [], []
    for x, y in series:
        x, y = np.asarray(x, float), np.asarray(y, float)
        ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
        if ok.sum() >= 2:
            lx, ly = np.log(x[ok]), np.log(y[ok])
            xs.append(lx - lx.mean())
            ys.append(ly - ly.mean())
    if not xs:
        return {"exponent": math.nan, "n": 0, "series": 0}
    cx, cy = np.concatenate(xs), np.concatenate(ys)
    den = float((cx ** 2).sum())
    return {"exponent": float((cx * cy).sum() / den) if den > 0 else math.nan, "n": int(cx.size), "series": len(xs)}


# --------------------------------------------------------------------------------------- law values
def family_norms(tracker, values) -> dict[str, float]:
    """Per family of ``tracker``, the Euclidean norm over its entries (Frobenius for Gram laws) of
    ``values`` (a ``conserve.tracker.Values`` in the tracker's plan layout). Host floats."""
    parts = tracker.compiled.split(values.vec, values.grams)
    sq: dict[str, torch.Tensor] = {}
    for law, v in zip(tracker.laws, parts):
        s = v.double().square().sum()
        sq[law.family] = sq[law.family] + s if law.family in sq else s
    return {f: math.sqrt(float(s)) for f, s in sorted(sq.items())}


def linear_families(tracker) -> list[str]:
    """Families all of whose laws are linear (h = c . theta): router_sum, translation."""
    kinds: dict[str, set] = {}
    for law in tracker.laws:
        kinds.setdefault(law.family, set()).add(bool(law.linear))
    return sorted(f for f, k in kinds.items() if k == {True})


def fmt(v, spec: str = ".3e") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def tasks_from_args(args, dtype):
    """``make_tasks`` with the data, model and batch options shared by the experiment CLIs."""
    return make_tasks(args.models, data=args.data, images=args.images, batch_size=args.batch_size, seq_len=args.seq_len,
                      image_batch=args.image_batch, image_limit=args.image_limit, hidden_size=args.hidden, dtype=dtype,
                      seed=args.seed, device=args.device)
