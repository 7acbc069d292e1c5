"""``conserve experiment continuity``: the geometric-continuity ablation of Jeong, Paeng, Suh 2026.

Part ``mlp``: a residual MLP on MNIST, ``h <- embed(x)``, then per layer ``h <- h + act(W_l h)`` (``NoRes``:
``h <- relu(W_l h)``), then ``head(h)``; depth 16, width 256, hidden weights ``layers.{l}.fc.weight`` without
bias. Variants: NoRes, Res+None (linear residual net), Res+Radial (``act(z) = z tanh(||z||)``, rotation-
equivariant), Res+ReLU, Res+GELU, Res+SiLU. Init: PyTorch's default ``nn.Linear`` init for the residual nets,
Kaiming-normal (ReLU gain) for NoRes so that the plain 16-layer net trains at all.
Part ``lm``: the project's reference LM (``conserve.models.lm.DecoderLM``, HF Llama names) trained on bytes of
a text file; one model per ``--lm-acts`` entry; continuity per projection type (q, k, v, o, gate, up, down).

Metrics (``conserve.continuity``): cumulative gradient coherence of adjacent layers (``ContinuityMonitor``
running gradient sums), weight continuity ``|cos|`` of v1 (input space) and u1 (output space) from an exact
SVD at the end (and the monitor's warm-started power iteration along the way), sigma^2-weighted alignments.
Paper: coherence ~0.93 with residuals vs ~0.05 without; weight continuity high only with element-wise
activations, ~0.22 for Res+None and Res+Radial; in transformers q, k, gate, up continuous in v1, o and down
in u1, v low.

Output (``--out DIR``): ``results.md``, ``results.json`` (config, final table, curves), ``mlp_curves.png``,
``lm_curves.png``.
"""
from __future__ import annotations

import gzip
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..report import json_safe
from ..commands.continuity import observed
from ..continuity import ContinuityMonitor, continuity_report, random_baseline
from ..errors import UsageError

VARIANTS = {  # name -> (residual, activation)
    "NoRes": (False, "relu"),
    "Res+None": (True, "none"),
    "Res+Radial": (True, "radial"),
    "Res+ReLU": (True, "relu"),
    "Res+GELU": (True, "gelu"),
    "Res+SiLU": (True, "silu"),
}
PARTS = ("mlp", "lm", "all")


def radial(z: torch.Tensor) -> torch.Tensor:
    """Rotation-equivariant activation ``z * tanh(||z||)`` (norm over the last dim): ``radial(R z) = R radial(z)``."""
    return z * torch.tanh(torch.linalg.vector_norm(z, dim=-1, keepdim=True))


ACTIVATIONS = {"none": lambda z: z, "radial": radial, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}


class _Layer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)


class ResidualMLP(nn.Module):
    """``(B, in_features) -> (B, classes)``; hidden weights ``layers.{l}.fc.weight`` (width x width).

    ``residual=False`` gives the plain net ``h <- act(W h)`` (Kaiming-normal init); ``activation`` is a key
    of ``ACTIVATIONS``."""

    def __init__(self, residual: bool, activation: str, depth: int = 16, width: int = 256,
                 in_features: int = 784, classes: int = 10):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, not {activation!r}")
        self.residual, self.act = residual, ACTIVATIONS[activation]
        self.embed = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(_Layer(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        if not residual:
            for layer in self.layers:
                nn.init.kaiming_normal_(layer.fc.weight, nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            z = self.act(layer.fc(h))
            h = h + z if self.residual else z
        return self.head(h)


@dataclass
class MLPConfig:
    depth: int = 16
    width: int = 256
    steps: int = 2000
    batch_size: int = 128
    lr: float = 1e-3
    optimizer: str = "adam"
    log_every: int = 50
    seed: int = 0
    variants: tuple[str, ...] = tuple(VARIANTS)
    device: str = "cpu"


@dataclass
class LMAblationConfig:
    acts: tuple[str, ...] = ("swiglu",)
    hidden_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 344
    seq_len: int = 128
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    log_every: int = 50
    seed: int = 0
    device: str = "cpu"


def _optimizer(name: str, params, lr: float):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise UsageError(f"--optimizer must be 'adam' or 'sgd', not {name!r}")


def _summaries(metrics: dict[str, torch.Tensor], types) -> dict[str, float]:
    """Per-type means -> {metric/type: float} (one host transfer)."""
    keys = [k for k in metrics if k.count("/") == 2 and k.split("/")[2] in types]
    if not keys:
        return {}
    vals = torch.stack([metrics[k].float() for k in keys]).cpu().tolist()
    return {k.removeprefix("continuity/"): v for k, v in zip(keys, vals)}


def _train(model, batch, steps, opt, monitor, log_every, progress=None, task=None) -> dict:
    """Train ``steps`` steps; ``batch(step) -> (x, y)``; cross-entropy. Returns the curves (host floats)."""
    types = list(monitor.groups)
    curve: dict[str, list[float]] = {"step": [], "loss": []}
    loss_acc, n_acc = None, 0
    for step in range(1, steps + 1):
        x, y = batch(step)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        monitor.update()
        d = loss.detach()
        loss_acc = d if loss_acc is None else loss_acc + d
        n_acc += 1
        if step % log_every == 0 or step == steps:
            lv = float(loss_acc / n_acc)
            if not math.isfinite(lv):
                raise UsageError(f"the loss became {lv} at step {step}; lower --lr")
            curve["step"].append(step)
            curve["loss"].append(lv)
            for k, v in _summaries(monitor.metrics(), types).items():
                curve.setdefault(k, []).append(v)
            loss_acc, n_acc = None, 0
        if progress is not None:
            progress.advance(task)
    return curve


def _final_table(model, monitor) -> dict[str, dict[str, float]]:
    """Per type: exact-SVD v1/u1 continuity, alignments, coherence, random baselines."""
    params = dict(model.named_parameters())
    reps = continuity_report(monitor.groups, lambda n: params[n].detach(), method="svd")
    mon = {k: float(v) for k, v in monitor.metrics().items()}
    out = {}
    for rep in reps:
        out[rep.type] = {
            "v1": rep.mean("v1"), "u1": rep.mean("u1"),
            "align_in": rep.mean("align_in"), "align_out": rep.mean("align_out"),
            "coherence": mon.get(f"continuity/coherence/{rep.type}", float("nan")),
            "baseline_v1": random_baseline(rep.shape[1]), "baseline_u1": random_baseline(rep.shape[0]),
            "dims": [rep.shape[1], rep.shape[0]],
            "pairs": len(rep.pairs),
        }
    return out


def mnist_tensors(root) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y): images normalised with the MNIST mean/std, flattened to 784, float32."""
    from ..images import MNIST_MEAN, MNIST_STD, load_mnist

    out = []
    for split in ("train", "test"):
        x, y = load_mnist(root, split)
        out += [((x.float() / 255 - MNIST_MEAN) / MNIST_STD).reshape(len(x), -1), y]
    return tuple(out)


def run_mlp_ablation(cfg: MLPConfig, data, progress=None) -> dict:
    """Train every variant of ``cfg.variants`` on ``data = (train_x, train_y, test_x, test_y)``.

    Returns ``{variant: {"final": {...}, "test_accuracy": float, "curve": {...}, "seconds": float}}`` where
    ``final`` holds the metrics of type ``fc`` (``_final_table``)."""
    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    dev = torch.device(cfg.device)
    xtr, ytr, xte, yte = (t.to(dev) for t in data)
    results = {}
    for name in cfg.variants:
        residual, act = VARIANTS[name]
        torch.manual_seed(cfg.seed)
        model = ResidualMLP(residual, act, cfg.depth, cfg.width, xtr.shape[1], int(ytr.max()) + 1).to(dev)
        opt = _optimizer(cfg.optimizer, model.parameters(), cfg.lr)
        mon = ContinuityMonitor(model, seed=cfg.seed)
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)

        def batch(step):
            idx = torch.randint(0, len(xtr), (cfg.batch_size,), generator=gen).to(dev)
            return xtr[idx], ytr[idx]

        task = progress.add_task(f"mlp {name}", total=cfg.steps) if progress is not None else None
        t0 = time.perf_counter()
        curve = _train(model, batch, cfg.steps, opt, mon, cfg.log_every, progress, task)
        with torch.no_grad():
            acc = sum(int((model(xte[i:i + 2000]).argmax(-1) == yte[i:i + 2000]).sum())
                      for i in range(0, len(xte), 2000)) / max(1, len(xte))
        results[name] = {"final": _final_table(model, mon)["fc"], "test_accuracy": acc, "curve": curve,
                         "seconds": time.perf_counter() - t0}
    return results


def read_text_bytes(path) -> torch.Tensor:
    """Bytes of a text file (``.gz`` allowed) as an int64 tensor of token ids 0-255."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"text file not found: {path}; pass --text FILE (e.g. shared/data/tinyshakespeare/input.txt.gz)")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except Exception as e:  # noqa: BLE001 -- any decode failure is the same user error
            raise UsageError(f"text file {path} is a corrupt gzip file ({e}); replace it") from e
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def run_lm_ablation(cfg: LMAblationConfig, tokens: torch.Tensor, progress=None) -> dict:
    """Train the reference LM (byte vocabulary, 256) once per ``cfg.acts``; per-type final continuity.

    Returns ``{act: {"final": {type: {...}}, "init": {type: {...}}, "curve": {...}, "seconds": float}}``."""
    try:
        from ..models.lm import DecoderLM, LMConfig
    except ImportError as e:  # pragma: no cover - depends on the build
        raise UsageError(f"the reference LM (conserve.models.lm) is not available ({e}); run --part mlp") from e
    dev = torch.device(cfg.device)
    if len(tokens) < cfg.seq_len + 2:
        raise UsageError(f"the text has {len(tokens)} bytes, fewer than --seq-len {cfg.seq_len} + 2; use a longer text")
    toks = tokens.to(dev)
    results = {}
    for act in cfg.acts:
        torch.manual_seed(cfg.seed)
        model = DecoderLM(LMConfig(vocab_size=256, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                                   num_attention_heads=cfg.num_attention_heads,
                                   num_key_value_heads=cfg.num_key_value_heads,
                                   intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.seq_len,
                                   hidden_act=act)).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        mon = ContinuityMonitor(model, seed=cfg.seed)
        init = _final_table(model, mon)
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        offs = torch.arange(cfg.seq_len + 1, device=dev)

        def batch(step):
            start = torch.randint(0, len(toks) - cfg.seq_len - 1, (cfg.batch_size, 1), generator=gen).to(dev)
            chunk = toks[start + offs]
            return chunk[:, :-1], chunk[:, 1:]

        task = progress.add_task(f"lm {act}", total=cfg.steps) if progress is not None else None
        t0 = time.perf_counter()
        curve = _train(model, batch, cfg.steps, opt, mon, cfg.log_every, progress, task)
        results[act] = {"final": _final_table(model, mon), "init": init, "curve": curve,
                        "seconds": time.perf_counter() - t0}
    return results


# ------------------------------------------------------------------------------------------ output
PAPER_MLP = {"NoRes": "coherence ~0.05", "Res+None": "weight continuity ~0.22", "Res+Radial": "weight continuity ~0.22",
             "Res+ReLU": "high weight continuity", "Res+GELU": "high weight continuity",
             "Res+SiLU": "high weight continuity"}
PAPER_LM = {"q_proj": "v1", "k_proj": "v1", "gate_proj": "v1", "up_proj": "v1", "o_proj": "u1",
            "down_proj": "u1", "v_proj": "low"}


def _f(x: float) -> str:
    return "-" if x != x else f"{x:.3f}"


def mlp_markdown(res: dict) -> str:
    lines = ["| variant | grad coherence | v1 continuity | u1 continuity | align_in | align_out | test acc | final loss | paper |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        f = r["final"]
        lines.append(f"| {name} | {_f(f['coherence'])} | {_f(f['v1'])} | {_f(f['u1'])} | {_f(f['align_in'])} | "
                     f"{_f(f['align_out'])} | {r['test_accuracy']:.3f} | {r['curve']['loss'][-1]:.3f} | {PAPER_MLP.get(name, '')} |")
    if res:
        f = next(iter(res.values()))["final"]
        lines.append(f"\nRandom baseline for |cos|: {f['baseline_v1']:.3f} (v1), {f['baseline_u1']:.3f} (u1). "
                     "Means over the adjacent-layer pairs; v1/u1 from an exact SVD of the final weights.")
    return "\n".join(lines)


def lm_markdown(res: dict) -> str:
    out = []
    for act, r in res.items():
        out.append(f"\n**hidden_act={act}** (init -> final)\n")
        out.append("| type | v1 | u1 | align_in | align_out | grad coherence | observed | paper |")
        out.append("|---|---|---|---|---|---|---|---|")
        for t, f in r["final"].items():
            i = r["init"][t]
            d_in, d_out = f["dims"]
            obs = observed(f["v1"], f["u1"], d_in, d_out)
            paper = PAPER_LM.get(t.split(".")[-1], "")
            out.append(f"| {t} | {_f(i['v1'])} -> {_f(f['v1'])} | {_f(i['u1'])} -> {_f(f['u1'])} | "
                       f"{_f(f['align_in'])} | {_f(f['align_out'])} | {_f(f['coherence'])} | {obs} | {paper} |")
    out.append("\n'observed': the space (v1 or u1) with the larger continuity, if above 3x its random baseline"
               " sqrt(2/(pi d)); else 'low'.")
    return "\n".join(out)


def plot_curves(res: dict, path: Path, title: str, metrics=("coherence", "v1", "u1", "loss")) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    types = sorted({k.split("/", 1)[1] for r in res.values() for k in r["curve"] if "/" in k})
    many = len(types) > 1  # LM: colour = projection type, line style = variant; MLP: colour = variant
    for ax, metric in zip(axes, metrics):
        for vi, (name, r) in enumerate(res.items()):
            c = r["curve"]
            keys = [k for k in c if k.startswith(metric + "/")] if metric != "loss" else ["loss"]
            for k in keys:
                t = k.split("/", 1)[1] if "/" in k else ""
                color = colors[(types.index(t) if many and t in types else vi) % len(colors)]
                label = f"{name} {t.split('.')[-1]}" if many and t else name
                ax.plot(c["step"], c[k], label=label, color=color, ls=styles[vi % len(styles)] if many else "-")
        ax.set_title({"coherence": "cumulative gradient coherence", "v1": "|cos v1| adjacent layers",
                      "u1": "|cos u1| adjacent layers", "loss": "train loss"}.get(metric, metric))
        ax.set_xlabel("step")
        if metric == "loss":
            ax.set_yscale("log")
    if many:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center", fontsize=7)
    else:
        axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI
def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="run directory for results.md/json and the PNG curves")
    p.add_argument("--part", choices=PARTS, default="all", help="mlp (MNIST), lm (text) or all")
    p.add_argument("--mnist", help="directory with the MNIST idx files (.gz or plain), for --part mlp/all")
    p.add_argument("--text", help="text file (.gz allowed) for the LM ablation, for --part lm/all")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of MLP variants")
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000, help="MLP training steps per variant")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lm-acts", default="swiglu", help="comma list of LM hidden_act values (swiglu, relu, gelu, silu)")
    p.add_argument("--lm-steps", type=int, default=1000)
    p.add_argument("--lm-layers", type=int, default=8)
    p.add_argument("--lm-hidden", type=int, default=128)
    p.add_argument("--lm-batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lm-lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise UsageError(f"--device {device!r} is not a torch device ({e}); use cpu or cuda") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; use --device cpu")


def _positive(**kw) -> None:
    for k, v in kw.items():
        if v < 1:
            raise UsageError(f"--{k.replace('_', '-')} must be >= 1, got {v}")


def main(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    _check_device(args.device)
    _positive(depth=args.depth, width=args.width, steps=args.steps, batch_size=args.batch_size,
              lm_steps=args.lm_steps, lm_layers=args.lm_layers, lm_hidden=args.lm_hidden,
              lm_batch_size=args.lm_batch_size, seq_len=args.seq_len, log_every=args.log_every)
    do_mlp, do_lm = args.part in ("mlp", "all"), args.part in ("lm", "all")
    if do_mlp and not args.mnist:
        raise UsageError("--part mlp needs --mnist DIR (the directory with the MNIST idx files)")
    if do_lm and not args.text:
        raise UsageError("--part lm needs --text FILE (e.g. tinyshakespeare/input.txt.gz)")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write_test").write_text("")
        (out / ".write_test").unlink()
    except OSError as e:
        raise UsageError(f"cannot write to --out {out}: {e.strerror}; choose a writable directory") from e
    mcfg = MLPConfig(depth=args.depth, width=args.width, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     optimizer=args.optimizer, log_every=args.log_every, seed=args.seed,
                     variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()), device=args.device)
    lcfg = LMAblationConfig(acts=tuple(a.strip() for a in args.lm_acts.split(",") if a.strip()),
                            hidden_size=args.lm_hidden, num_hidden_layers=args.lm_layers,
                            intermediate_size=int(round(args.lm_hidden * 8 / 3 / 8)) * 8, seq_len=args.seq_len,
                            steps=args.lm_steps, batch_size=args.lm_batch_size, lr=args.lm_lr,
                            log_every=args.log_every, seed=args.seed, device=args.device)
    bad = [a for a in lcfg.acts if a not in ("swiglu", "relu", "gelu", "silu")]
    if do_lm and bad:
        raise UsageError(f"--lm-acts: unknown activation(s) {bad}; choose from swiglu, relu, gelu, silu")
    data = mnist_tensors(args.mnist) if do_mlp else None
    tokens = read_text_bytes(args.text) if do_lm else None
    console = Console(stderr=True)
    record: dict = {"config": {"mlp": asdict(mcfg) if do_mlp else None, "lm": asdict(lcfg) if do_lm else None},
                    "source": "Jeong, Paeng, Suh 2026 (spec laws.md, Geometric continuity)"}
    md = ["# Geometric continuity ablation (Jeong, Paeng, Suh 2026)\n"]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        if do_mlp:
            res = run_mlp_ablation(mcfg, data, progress)
            record["mlp"] = res
            md += [f"## Residual MLP on MNIST (depth {mcfg.depth}, width {mcfg.width}, {mcfg.steps} steps, "
                   f"{mcfg.optimizer} lr {mcfg.lr})\n", mlp_markdown(res), "\n![curves](mlp_curves.png)\n"]
            plot_curves(res, out / "mlp_curves.png", "residual MLP on MNIST")
        if do_lm:
            res = run_lm_ablation(lcfg, tokens, progress)
            record["lm"] = res
            md += [f"## Reference LM on {Path(args.text).name} (bytes; {lcfg.num_hidden_layers} layers, hidden "
                   f"{lcfg.hidden_size}, {lcfg.steps} steps)\n", lm_markdown(res), "\n![curves](lm_curves.png)\n"]
            plot_curves(res, out / "lm_curves.png", "reference LM: per projection type", metrics=("coherence", "v1", "u1", "loss"))
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(json_safe(record), indent=1))
    print("\n".join(md))
    console.print(f"wrote {out / 'results.md'}, {out / 'results.json'} and the PNG curves")
    return 0

