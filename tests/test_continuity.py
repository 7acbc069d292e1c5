"""Geometric continuity (Jeong, Paeng, Suh 2026; spec laws.md): metrics vs brute force, power iteration vs
torch.linalg.svd, the monitor, the image loaders, the CLI and a small-budget run of the MLP ablation."""
from __future__ import annotations

import gzip
import json
import os
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conserve.continuity import (
    ContinuityMonitor,
    abs_cos,
    continuity_report,
    gradient_coherence,
    gram_alignment,
    group_projections,
    leading_singular_vectors,
    power_iteration,
    random_baseline,
    split_layer_name,
)
from conserve.errors import UsageError
from conserve.images import load_cifar10, load_mnist, read_idx

# the shared real data: $CONSERVE_DATA, shared/ beside the clone (CI), or the workplace copy
DATA = next((p for p in (Path(os.environ.get("CONSERVE_DATA", "/nonexistent")),
                         Path(__file__).resolve().parents[2] / "shared" / "data", Path("/work/shared/data"))
             if p.is_dir()), Path(__file__).resolve().parents[2] / "shared" / "data")
MNIST = DATA / "mnist"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # small matrices: one thread is faster and immune to oversubscription on a busy 2-core box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gapped(m: int, n: int, gen: torch.Generator, top: float = 3.0, dtype=torch.float32) -> torch.Tensor:
    """Random (m, n) with singular values top, 1, ..., 0.1 (spectral gap top)."""
    u = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    k = min(m, n)
    s = torch.linspace(1.0, 0.1, k, dtype=torch.float64)
    s[0] = top
    return ((u[:, :k] * s) @ v[:, :k].T).to(dtype)


# ------------------------------------------------------------------------------------------ grouping
def test_split_layer_name():
    assert split_layer_name("model.layers.3.self_attn.q_proj.weight") == ("model.layers", "self_attn.q_proj", 3)
    assert split_layer_name("blocks.12.fc.weight") == ("blocks", "fc", 12)
    assert split_layer_name("net.2.weight") == ("net", "net", 2)
    assert split_layer_name("0.weight") == ("", "weight", 0)
    assert split_layer_name("lm_head.weight") is None
    # the FIRST .<int>. is the layer: an expert index stays in the type
    assert split_layer_name("model.layers.1.mlp.experts.5.up_proj.weight") == ("model.layers", "mlp.experts.5.up_proj", 1)


def test_group_projections_hf_names_and_collisions():
    shapes = {f"model.layers.{i}.self_attn.q_proj.weight": (8, 8) for i in (2, 0, 1)}
    shapes |= {f"model.layers.{i}.input_layernorm.weight": (8,) for i in range(3)}   # 1-D: skipped
    shapes |= {"model.layers.0.mlp.only_once.weight": (4, 8), "lm_head.weight": (5, 8)}  # one layer / no layer
    shapes |= {f"encoder.layers.{i}.fc.weight": (4, 4) for i in range(2)}
    shapes |= {f"decoder.layers.{i}.fc.weight": (4, 4) for i in range(2)}
    shapes |= {f"convs.{i}.weight": (6, 3, 2, 2) for i in range(2)}
    g = group_projections(shapes)
    assert list(g) == ["convs", "decoder.layers.fc", "encoder.layers.fc", "self_attn.q_proj"]
    assert [p.layer for p in g["self_attn.q_proj"]] == [0, 1, 2]
    assert g["convs"][0].shape == (6, 12)
    assert list(group_projections(shapes, types=["convs"])) == ["convs"]
    with pytest.raises(ValueError, match="both map"):
        group_projections({"a.0.b.weight": (2, 2), "a.0.b": (2, 2), "a.1.b.weight": (2, 2)})


def test_group_projections_reference_lm():
    from conserve.models.lm import DecoderLM, LMConfig

    model = DecoderLM(LMConfig(num_hidden_layers=3))
    g = group_projections(model.named_parameters())
    assert set(g) == {f"self_attn.{t}_proj" for t in "qkvo"} | {f"mlp.{t}_proj" for t in ("gate", "up", "down")}
    assert all(len(ps) == 3 for ps in g.values())


# ------------------------------------------------------------------------------------------ power iteration
def test_power_iteration_matches_svd_batched():
    gen = torch.Generator().manual_seed(0)
    w = torch.stack([gapped(48, 32, gen), gapped(48, 32, gen, top=2.0), gapped(48, 32, gen, top=5.0)])
    U, S, Vh = torch.linalg.svd(w.double())
    u, s, v = power_iteration(w, torch.randn(3, 32, generator=gen), steps=12)
    assert abs_cos(v.double(), Vh[:, 0]).min() >= 0.999
    assert abs_cos(u.double(), U[:, :, 0]).min() >= 0.999
    torch.testing.assert_close(s.double(), S[:, 0], rtol=1e-3, atol=0)
    # (u, v) is a consistent pair: u = W v / ||W v||, sigma = u^T W v > 0
    torch.testing.assert_close(torch.einsum("bm,bmn,bn->b", u, w, v), s, rtol=1e-4, atol=1e-5)
    # unbatched call and a warm start: one step from the converged vector on a perturbed matrix stays accurate
    w2 = w[1] + 0.01 * torch.randn(48, 32, generator=gen)
    u2, _, v2 = power_iteration(w2, v[1], steps=1)
    _, _, vh2 = torch.linalg.svd(w2.double())
    assert float(abs_cos(v2.double(), vh2[0])) >= 0.999
    # a step never flips the sign of the warm start
    assert float((v2 * v[1]).sum()) > 0


def test_power_iteration_zero_matrix_keeps_vector():
    v0 = torch.nn.functional.normalize(torch.randn(2, 5), dim=-1)
    _, s, v = power_iteration(torch.zeros(2, 4, 5), v0, steps=2)
    assert torch.equal(s, torch.zeros(2)) and torch.allclose(v, v0)


@pytest.mark.parametrize("method", ["svd", "block"])
def test_leading_singular_vectors(method):
    gen = torch.Generator().manual_seed(1)
    w = torch.stack([gapped(40, 60, gen, top=1.3), gapped(40, 60, gen, top=1.1)])  # small gaps: block needs Ritz
    u, s, v, info = leading_singular_vectors(w, method=method, tol=1e-10, generator=gen)
    U, S, Vh = torch.linalg.svd(w.double())
    assert info["converged"]
    assert abs_cos(v.double(), Vh[:, 0]).min() >= 0.999999
    assert abs_cos(u.double(), U[:, :, 0]).min() >= 0.999999
    torch.testing.assert_close(s.double(), S[:, 0], rtol=1e-5, atol=0)
    # sign convention: largest-magnitude entry of v1 positive
    assert bool((v.gather(1, v.abs().argmax(1, keepdim=True)) > 0).all())
    with pytest.raises(ValueError, match="method"):
        leading_singular_vectors(w, method="qr")


# ------------------------------------------------------------------------------------------ metrics vs brute force
def test_metrics_match_brute_force():
    gen = torch.Generator().manual_seed(2)
    wa, wb = torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randn(7, 5, generator=gen, dtype=torch.float64)
    # alignment: form the Grams explicitly
    for space, ga, gb in (("input", wa.T @ wa, wb.T @ wb), ("output", wa @ wa.T, wb @ wb.T)):
        ref = torch.trace(ga @ gb) / (torch.linalg.norm(ga) * torch.linalg.norm(gb))
        torch.testing.assert_close(gram_alignment(wa, wb, space), ref, rtol=1e-12, atol=0)
    # a Gram proportional to itself gives 1; orthogonal supports give 0
    torch.testing.assert_close(gram_alignment(wa, 3 * wa, "input"), torch.tensor(1.0, dtype=torch.float64))
    e1, e2 = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64)
    e1[0, 0], e2[1, 1] = 1, 1
    assert float(gram_alignment(e1, e2, "input")) == 0.0 and float(gram_alignment(e1, e2, "output")) == 0.0
    with pytest.raises(ValueError, match="in_features"):
        gram_alignment(wa, wa.T, "input")
    # batched alignment equals the loop
    ws = torch.randn(4, 6, 3, generator=gen, dtype=torch.float64)
    batched = gram_alignment(ws[:-1], ws[1:], "output")
    torch.testing.assert_close(batched, torch.stack([gram_alignment(ws[i], ws[i + 1], "output") for i in range(3)]))
    # |cos| and coherence
    a, b = torch.randn(9, generator=gen, dtype=torch.float64), torch.randn(9, generator=gen, dtype=torch.float64)
    ref = abs(float(a @ b)) / (float(a.norm()) * float(b.norm()))
    assert math.isclose(float(abs_cos(a, -b)), ref, rel_tol=1e-12)
    assert math.isclose(float(gradient_coherence(a.view(3, 3), -b.view(3, 3))), -ref * math.copysign(1, float(a @ b)),
                        rel_tol=1e-12)
    assert float(abs_cos(a, torch.zeros(9, dtype=torch.float64))) == 0.0
    # random baseline: mean |cos| of random unit vectors
    x = torch.nn.functional.normalize(torch.randn(4000, 2, 64, generator=gen, dtype=torch.float64), dim=-1)
    assert abs(float(abs_cos(x[:, 0], x[:, 1]).mean()) - random_baseline(64)) < 0.01


class Stack(nn.Module):
    """Plain Linear stack with gapped weights (names layers.{i}.fc.weight) and a readout."""

    def __init__(self, depth=4, width=12, gen=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(width, width, bias=False)}) for _ in range(depth))
        self.proj = nn.ModuleList(nn.Linear(width, 6, bias=False) for _ in range(depth))  # type "proj", other shape
        with torch.no_grad():
            for l in self.layers:
                l["fc"].weight.copy_(gapped(width, width, gen, top=4.0))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        for l, p in zip(self.layers, self.proj):
            x = torch.tanh(l["fc"](x)) + 0.1 * p(x).sum(-1, keepdim=True)
        return self.out(x)


@pytest.mark.parametrize("stack_max_numel", [2 ** 20, 0])  # stacked bmm path / per-matrix mv path
def test_monitor_matches_brute_force_and_state_roundtrip(stack_max_numel):
    gen = torch.Generator().manual_seed(3)
    model = Stack(gen=gen)
    mon = ContinuityMonitor(model, power_steps=4, stack_max_numel=stack_max_numel)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    saved = None
    for step in range(6):
        loss = nn.functional.cross_entropy(model(x + 0.1 * step), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for n, p in model.named_parameters():
            sums[n] += p.grad.double()
        mon.update()
        if step == 2:
            saved = mon.state_dict()
            twin = ContinuityMonitor(model, power_steps=4, seed=99)
            twin.load_state_dict(saved)
    m = mon.metrics()
    assert set(k.split("/")[1] for k in m) == {"v1", "u1", "align_in", "align_out", "coherence"}
    assert all(v.dim() == 0 for v in m.values())
    for t in ("fc", "proj"):
        names = [f"layers.{i}.fc.weight" if t == "fc" else f"proj.{i}.weight" for i in range(4)]
        ws = [dict(model.named_parameters())[n].detach().double() for n in names]
        per = []
        for i in range(3):
            U1, _, V1 = torch.linalg.svd(ws[i])
            U2, _, V2 = torch.linalg.svd(ws[i + 1])
            coh = float((sums[names[i]] * sums[names[i + 1]]).sum() / (sums[names[i]].norm() * sums[names[i + 1]].norm()))
            key = f"{i}-{i + 1}"
            assert math.isclose(float(m[f"continuity/coherence/{t}/{key}"]), coh, rel_tol=1e-4, abs_tol=1e-5)
            ga, gb = ws[i].T @ ws[i], ws[i + 1].T @ ws[i + 1]
            ref = float(torch.trace(ga @ gb) / (ga.norm() * gb.norm()))
            assert math.isclose(float(m[f"continuity/align_in/{t}/{key}"]), ref, rel_tol=1e-4)
            if t == "fc":  # gapped weights: the warm-started power iteration has converged
                assert math.isclose(float(m[f"continuity/v1/{t}/{key}"]), abs(float(V1[0] @ V2[0])), abs_tol=2e-3)
                assert math.isclose(float(m[f"continuity/u1/{t}/{key}"]), abs(float(U1[:, 0] @ U2[:, 0])), abs_tol=2e-3)
            per.append(coh)
        assert math.isclose(float(m[f"continuity/coherence/{t}"]), sum(per) / 3, rel_tol=1e-4, abs_tol=1e-5)
    # restored twin continued over the same steps gives the same metrics: replay steps 3..5 is not possible on the
    # same model, so check the restored state itself instead
    assert twin.num_updates == 3
    for i, n in enumerate(twin.names):
        torch.testing.assert_close(twin.sums[i], saved["grad_sum"][n])
        torch.testing.assert_close(twin._vectors(i)[1], saved["v"][n])
    with pytest.raises(ValueError, match="no 'u'"):
        twin.load_state_dict({"u": {}, "v": {}})
    with pytest.raises(ValueError, match="two or more layers"):
        ContinuityMonitor(nn.Linear(3, 3))


def test_monitor_resume_continues_identically():
    """Monitor A over 4 steps == monitor B restored from A's state after 2 steps and fed the same last 2 steps."""
    gen = torch.Generator().manual_seed(4)
    model = Stack(gen=gen)
    ws = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    grads = []
    for _ in range(4):  # fixed sequence of (weights, grads)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        ws.append({n: p.detach().clone() for n, p in model.named_parameters()})
        grads.append({n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()})

    def feed(mon, steps):
        for k in steps:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(ws[k + 1][n])
                    p.grad = grads[k][n]
            mon.update()

    a = ContinuityMonitor(model, alignment=False)
    feed(a, range(2))
    b = ContinuityMonitor(model, alignment=False, seed=7)
    b.load_state_dict(a.state_dict())
    feed(a, range(2, 4))
    feed(b, range(2, 4))
    ma, mb = a.metrics(), b.metrics()
    assert ma.keys() == mb.keys()
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=1e-6, atol=1e-7)


def test_monitor_bfloat16_weights():
    """Half-precision weights are multiplied in their dtype: metrics agree with float64 to ~1e-2."""
    gen = torch.Generator().manual_seed(8)
    model = Stack(gen=gen).to(torch.bfloat16)
    ws = [model.layers[i]["fc"].weight.detach().double() for i in range(4)]
    for stack in (2 ** 20, 0):
        m = ContinuityMonitor(model, coherence=False, stack_max_numel=stack).metrics()
        for i in range(3):
            _, _, v1 = torch.linalg.svd(ws[i])
            _, _, v2 = torch.linalg.svd(ws[i + 1])
            assert m[f"continuity/v1/fc/{i}-{i + 1}"].dtype == torch.float32
            assert math.isclose(float(m[f"continuity/v1/fc/{i}-{i + 1}"]), abs(float(v1[0] @ v2[0])), abs_tol=1e-2)
            ref = float(gram_alignment(ws[i], ws[i + 1], "output"))
            assert math.isclose(float(m[f"continuity/align_out/fc/{i}-{i + 1}"]), ref, abs_tol=1e-2)


def test_monitor_every_and_missing_grads():
    gen = torch.Generator().manual_seed(5)
    model = Stack(gen=gen)
    mon = ContinuityMonitor(model, every=3, coherence=True)
    v0 = mon._vectors(0)[1].clone()
    mon.update()  # no grads at all: only the counter moves
    mon.update()
    assert torch.equal(mon._vectors(0)[1], v0) and mon.num_power == 0
    assert all(float(s.abs().sum()) == 0 for s in mon.sums)
    mon.update()
    assert mon.num_power == 1 and not torch.equal(mon._vectors(0)[1], v0)


def test_continuity_report_matches_monitor_alignment():
    gen = torch.Generator().manual_seed(6)
    model = Stack(gen=gen)
    params = dict(model.named_parameters())
    mon = ContinuityMonitor(model, power_steps=30, coherence=False)
    m = mon.metrics()
    reps = {r.type: r for r in continuity_report(mon.groups, lambda n: params[n].detach(), method="svd")}
    assert reps["fc"].pairs == [(0, 1), (1, 2), (2, 3)]
    for i, (a, b) in enumerate(reps["fc"].pairs):
        for k in ("v1", "u1", "align_in", "align_out"):
            assert math.isclose(reps["fc"].values[k][i], float(m[f"continuity/{k}/fc/{a}-{b}"]), abs_tol=1e-3), k


# ------------------------------------------------------------------------------------------ image loaders
def _idx_bytes(arr: np.ndarray) -> bytes:
    return struct.pack(">HBB", 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape) + arr.tobytes()


def test_mnist_loader_synthetic_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labs = rng.integers(0, 10, 5, dtype=np.uint8)
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(imgs)))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(labs))   # plain works too
    x, y = load_mnist(tmp_path, "test")
    assert x.dtype == torch.uint8 and x.shape == (5, 28, 28) and torch.equal(x, torch.from_numpy(imgs))
    assert y.dtype == torch.int64 and torch.equal(y, torch.from_numpy(labs.astype(np.int64)))
    with pytest.raises(UsageError, match="train-images-idx3-ubyte"):
        load_mnist(tmp_path, "train")
    with pytest.raises(UsageError, match="not found"):
        load_mnist(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "t10k-images-idx3-ubyte").write_bytes(_idx_bytes(imgs)[:-7])             # truncated payload
    (bad / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(labs))[:-9])  # truncated gzip
    with pytest.raises(UsageError, match="truncated"):
        read_idx(bad / "t10k-images-idx3-ubyte")
    with pytest.raises(UsageError, match="corrupt or truncated gzip"):
        read_idx(bad / "t10k-labels-idx1-ubyte.gz")
    (bad / "x").write_bytes(b"\x12\x34\x08\x01")
    with pytest.raises(UsageError, match="not an IDX"):
        read_idx(bad / "x")
    mism = tmp_path / "mism"
    mism.mkdir()
    (mism / "t10k-images-idx3-ubyte").write_bytes(_idx_bytes(imgs))
    (mism / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(labs[:4]))
    with pytest.raises(UsageError, match="5 images but 4 labels"):
        load_mnist(mism, "test")


@pytest.mark.skipif(not MNIST.is_dir(), reason=f"real MNIST not at {MNIST} (CI lays shared/ beside the clone)")
def test_mnist_real_test_split():
    x, y = load_mnist(MNIST, "test")
    assert x.shape == (10000, 28, 28)
    assert y.bincount().tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]  # known class counts


def test_cifar10_loader(tmp_path):
    rng = np.random.default_rng(1)
    rec = np.concatenate([rng.integers(0, 10, (4, 1)), rng.integers(0, 256, (4, 3072))], 1).astype(np.uint8)
    d = tmp_path / "cifar-10-batches-bin"
    d.mkdir()
    (d / "test_batch.bin").write_bytes(rec.tobytes())
    x, y = load_cifar10(tmp_path, "test")
    assert x.shape == (4, 3, 32, 32) and torch.equal(y, torch.from_numpy(rec[:, 0].astype(np.int64)))
    assert torch.equal(x[2, 1].reshape(-1), torch.from_numpy(rec[2, 1 + 1024: 1 + 2048]))  # green plane
    f = tmp_path / "one.bin.gz"
    f.write_bytes(gzip.compress(rec.tobytes()))
    assert torch.equal(load_cifar10(f)[0], x)
    with pytest.raises(UsageError, match="no CIFAR-10 train batches"):
        load_cifar10(tmp_path, "train")
    (tmp_path / "short.bin").write_bytes(rec.tobytes()[:-1])
    with pytest.raises(UsageError, match="whole number"):
        load_cifar10(tmp_path / "short.bin")
    rec[0, 0] = 42
    (tmp_path / "lab.bin").write_bytes(rec.tobytes())
    with pytest.raises(UsageError, match="label 42"):
        load_cifar10(tmp_path / "lab.bin")
    with pytest.raises(UsageError, match="not found"):
        load_cifar10(tmp_path / "missing.bin")


# ------------------------------------------------------------------------------------------ CLI
def _save_llama_like(path: Path, layers=3, sharded=True, gen=None):
    from safetensors.torch import save_file

    h, i = 16, 24
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (8, h), "self_attn.v_proj": (8, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    tensors = {f"model.layers.{l}.{t}.weight": torch.randn(s, generator=gen).to(torch.bfloat16)
               for l in range(layers) for t, s in shapes.items()}
    tensors |= {f"model.layers.{l}.input_layernorm.weight": torch.ones(h) for l in range(layers)}
    tensors["model.embed_tokens.weight"] = torch.randn(32, h, generator=gen)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"))
        return tensors
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, ns in halves.items():
        save_file({n: tensors[n] for n in ns}, str(path / f))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: f for f, ns in halves.items() for n in ns}}))
    return tensors


def test_cli_continuity_checkpoint(tmp_path, capsys):
    from conserve.cli import main

    gen = torch.Generator().manual_seed(7)
    tensors = _save_llama_like(tmp_path / "ckpt", gen=gen)
    out = tmp_path / "out"
    assert main(["continuity", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    rec = json.loads((out / "continuity.json").read_text())
    assert (out / "continuity.png").stat().st_size > 1000 and "| self_attn.q_proj |" in (out / "continuity.md").read_text()
    row = {r["type"]: r for r in rec["types"]}
    assert set(row) == {f"self_attn.{t}_proj" for t in "qkvo"} | {f"mlp.{t}_proj" for t in ("gate", "up", "down")}
    # brute force for one pair: |cos| of the exact leading right singular vectors of layers 1 and 2
    w1, w2 = (tensors[f"model.layers.{l}.mlp.down_proj.weight"].double() for l in (1, 2))
    ref = abs(float(torch.linalg.svd(w1)[2][0] @ torch.linalg.svd(w2)[2][0]))
    assert math.isclose(rec["pairs"]["mlp.down_proj"]["v1"][1], ref, abs_tol=1e-4)
    assert rec["pairs"]["mlp.down_proj"]["pairs"] == [[0, 1], [1, 2]]
    # single-file checkpoint, type filter, no alignment
    _save_llama_like(tmp_path / "single", sharded=False, gen=gen)
    f = tmp_path / "single" / "model.safetensors"
    assert main(["continuity", str(f), "--out", str(tmp_path / "o2"), "--types", "mlp.up_proj", "--no-alignment",
                 "--method", "block"]) == 0
    rec2 = json.loads((tmp_path / "o2" / "continuity.json").read_text())
    assert [r["type"] for r in rec2["types"]] == ["mlp.up_proj"] and "align_in" not in rec2["types"][0]
    # user errors: exit 2 with one line naming the fix
    capsys.readouterr()
    assert main(["continuity", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    assert main(["continuity", str(tmp_path / "empty")]) == 2
    assert "convert to safetensors" in capsys.readouterr().err
    assert main(["continuity", str(f), "--types", "nope", "--out", str(out)]) == 2
    assert "types present" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the ablation
@pytest.mark.skipif(not MNIST.is_dir(), reason=f"real MNIST not at {MNIST} (CI lays shared/ beside the clone)")
def test_mlp_ablation_small_budget_ordering():
    """Paper's ordering on a small budget (depth 8, width 128, 100 Adam steps, 8k MNIST images; ~10 s)."""
    from conserve.experiments.continuity import MLPConfig, run_mlp_ablation

    x, y = load_mnist(MNIST, "test")  # the 10k test images are enough here and load fast
    x = ((x.float() / 255 - 0.1307) / 0.3081).reshape(len(x), -1)
    cfg = MLPConfig(depth=8, width=128, steps=100, batch_size=64, lr=3e-3, per_decade=2,
                    variants=("NoRes", "Res+None", "Res+Radial", "Res+ReLU"))
    r = run_mlp_ablation(cfg, (x[:8000], y[:8000], x[8000:], y[8000:]))
    f = {k: v["final"] for k, v in r.items()}
    assert f["NoRes"]["coherence"] < 0.2
    assert min(f[k]["coherence"] for k in ("Res+None", "Res+Radial", "Res+ReLU")) > 0.2
    for k in ("Res+None", "Res+Radial"):  # measured 0.70 vs 0.11 / 0.41 (the scaled radial has not decayed at 100 steps)
        assert f["Res+ReLU"]["v1"] > f[k]["v1"] + 0.1
    assert f["Res+ReLU"]["u1"] > f["Res+None"]["u1"] + 0.1
    assert all(v["test_accuracy"] > 0.5 for v in r.values())  # every variant learned something
    c = r["Res+ReLU"]["curve"]
    assert c["step"][0] == 0 and c["step"][-1] == 100 and c["step"] == sorted(set(c["step"]))  # init + log-spaced
    assert {"coherence/fc", "step_coherence/fc", "v1/fc", "dw_rel/fc"} <= set(c)
    assert c["dw_rel/fc"][0] == 0.0 and c["dw_rel/fc"][-1] > 0  # W - W0 starts at zero


@pytest.mark.skipif(not MNIST.is_dir(), reason=f"real MNIST not at {MNIST} (CI lays shared/ beside the clone)")
def test_radial_differs_from_none_at_default_init_and_seeds_give_mean_sd():
    """At the default init the literal z tanh(||z||) saturates: it IS Res+None (flagged by the saturation
    report); the scaled radial is not. Two seeds: every summary carries a mean and an sd over 2 values."""
    from conserve.experiments.continuity import MLPConfig, run_mlp_ablation

    x, y = load_mnist(MNIST, "test")
    x = ((x.float() / 255 - 0.1307) / 0.3081).reshape(len(x), -1)
    cfg = MLPConfig(depth=4, width=256, steps=30, batch_size=32, lr=3e-3, per_decade=1, seeds=2, probe_size=256,
                    variants=("Res+None", "Res+Radial", "Res+RadialUnscaled"))
    r = run_mlp_ablation(cfg, (x[:4000], y[:4000], x[9000:], y[9000:]))
    none, rad, lit = r["Res+None"], r["Res+Radial"], r["Res+RadialUnscaled"]
    assert lit["saturated"]["init"] > 0.99 and lit["activation"]["init"] < 1e-2
    assert any("effectively the identity" in w for w in lit["warnings"]) and not rad["warnings"] and not none["warnings"]
    assert rad["saturated"]["init"] < 0.5 and rad["activation"]["init"] > 0.1
    for m in ("v1", "coherence", "step_coherence_mean"):  # the scaled radial trains differently ...
        assert abs(rad["final"][m] - none["final"][m]) > 1e-3, m
        assert lit["final"][m] == pytest.approx(none["final"][m], abs=5e-3), m  # ... the literal one does not
    for v in r.values():
        for m in ("v1", "u1", "coherence", "dw_rel", "v1_peak", "v1_peak_step", "test_accuracy"):
            s = v["summary"][m]
            assert s["n"] == 2 and len(s["values"]) == 2 and s["sd"] >= 0 and math.isfinite(s["mean"]), m
            assert s["mean"] == pytest.approx(sum(s["values"]) / 2)
        assert [run["seed"] for run in v["runs"]] == [0, 1]
        assert v["runs"][0]["final"]["fc"]["v1"] != v["runs"][1]["final"]["fc"]["v1"]  # the seeds differ


def test_snapshot_metrics_against_references():
    from conserve.continuity import centred_gram_alignment, random_quantile, snapshot, subspace_overlap

    g = torch.Generator().manual_seed(3)
    d = 48
    # subspace overlap = mean squared cosine of the principal angles (independent: SVD of Va^T Vb)
    va = torch.linalg.qr(torch.randn(d, 4, generator=g, dtype=torch.float64)).Q
    vb = torch.linalg.qr(torch.randn(d, 4, generator=g, dtype=torch.float64)).Q
    cosines = torch.linalg.svdvals(va.T @ vb)
    assert float(subspace_overlap(va, vb)) == pytest.approx(float(cosines.square().mean()), rel=1e-12)
    assert float(subspace_overlap(va, va)) == pytest.approx(1.0)
    # centred alignment: 1 for proportional anisotropic Grams, ~0 for independent random weights
    w = torch.randn(d, d, generator=g, dtype=torch.float64) @ torch.diag(torch.linspace(0.2, 3, d, dtype=torch.float64))
    rot = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    assert float(centred_gram_alignment(w, 2 * rot @ w, "input")) == pytest.approx(1.0, abs=1e-12)
    ra, rb = (torch.randn(d, d, generator=g, dtype=torch.float64) for _ in range(2))
    assert abs(float(centred_gram_alignment(ra, rb))) < 0.1
    # the 99% quantile of the mean |cos|: d = 2 has the closed form P(|cos| <= c) = (2/pi) arcsin(c)
    assert random_quantile(2, 1, 0.99, draws=200000) == pytest.approx(math.sin(0.99 * math.pi / 2), abs=2e-3)
    assert random_quantile(256, 15) > random_baseline(256) > random_quantile(256, 15, q=0.01)
    # snapshot: v1 equal in every layer -> v1 = 1; aligned with the mean input -> v1_perp ~ random
    m = torch.rand(d, generator=g, dtype=torch.float64)
    mhat = m / m.norm()
    ws = [torch.randn(d, d, generator=g, dtype=torch.float64) * 0.01 + 5 * torch.outer(torch.randn(d, generator=g, dtype=torch.float64), mhat)
          for _ in range(4)]
    s = snapshot({"fc": ws}, init={"fc": [2 * w for w in ws]}, input_means={"fc": [m] * 4})["fc"]
    assert s["v1"] > 0.99 and s["v1_mean"] > 0.99 and s["v1_perp"] < 0.6 and s["n_pairs"] == 3
    assert s["dw_rel"] == pytest.approx(0.5) and s["dw_v1"] > 0.99  # W - 2W = -W
    assert s["s1_s2"] > 10 and len(s["pairs/v1"]) == 3


def test_experiment_cli_writes_run_dir(tmp_path):
    """Tiny end-to-end run of both parts on synthetic data through the CLI (idx files + a text file)."""
    from conserve.cli import main

    rng = np.random.default_rng(2)
    d = tmp_path / "mnist"
    d.mkdir()
    for split, n in (("train", 64), ("t10k", 32)):
        (d / f"{split}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))))
        (d / f"{split}-labels-idx1-ubyte").write_bytes(_idx_bytes(rng.integers(0, 10, n, dtype=np.uint8)))
    text = tmp_path / "t.txt"
    text.write_text("hello world, conservation laws. " * 40)
    out = tmp_path / "run"
    argv = ["experiment", "continuity", "--out", str(out), "--mnist", str(d), "--text", str(text),
            "--variants", "NoRes,Res+ReLU", "--depth", "3", "--width", "16", "--steps", "4", "--batch-size", "8",
            "--lm-steps", "3", "--lm-layers", "2", "--lm-hidden", "16", "--seq-len", "16", "--lm-batch-size", "2",
            "--per-decade", "1", "--lm-acts", "swiglu,none,radial"]
    assert main(argv) == 0
    rec = json.loads((out / "results.json").read_text())
    assert set(rec["mlp"]) == {"NoRes", "Res+ReLU"} and "self_attn.q_proj" in rec["lm"]["swiglu"]["final"]
    assert set(rec["lm"]) == {"swiglu", "none", "radial"}
    assert "mlp.gate_proj" in rec["lm"]["swiglu"]["final"] and "mlp.gate_proj" not in rec["lm"]["none"]["final"]
    for act in ("none", "radial"):  # the activation removed / replaced: up and down kept, time courses per type
        c = rec["lm"][act]["curve"]
        assert {"v1/mlp.up_proj", "u1/mlp.down_proj", "step_coherence/self_attn.v_proj"} <= set(c) and c["step"][0] == 0
    assert (out / "mlp_curves.png").is_file() and (out / "lm_curves.png").is_file()
    assert "| Res+ReLU |" in (out / "results.md").read_text()
    assert main(["experiment", "continuity", "--out", str(out), "--part", "mlp"]) == 2  # --mnist missing
    assert main(["experiment", "continuity", "--out", str(out), "--part", "mlp", "--mnist", str(d),
                 "--variants", "Res+Tanh"]) == 2


def test_tracker_integration_reference_lm():
    """The lead's Tracker calls update() after each step and metrics() at flush; state travels with it."""
    from conserve import MemorySink, Tracker
    from conserve.models.lm import DecoderLM, LMConfig

    torch.manual_seed(0)
    model = DecoderLM(LMConfig(num_hidden_layers=3))
    sink, mon = MemorySink(), ContinuityMonitor(model)
    tr = Tracker(model, every=2, sinks=[sink], monitors=[mon])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(4):
        loss = nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        tr.before_step(opt)
        opt.step()
        tr.after_step()
    tr.close()
    last = sink.records[-1]
    assert mon.num_updates == 4
    for t in ("self_attn.q_proj", "mlp.down_proj"):
        assert 0 <= last[f"continuity/v1/{t}"] <= 1 and -1 <= last[f"continuity/coherence/{t}/1-2"] <= 1
    twin = ContinuityMonitor(model, seed=1)
    Tracker(model, every=2, monitors=[twin]).load_state_dict(tr.state_dict())
    assert twin.num_updates == 4


def test_lm_mlp_activation_removed_or_replaced_and_radial_equivariant():
    from conserve.experiments.continuity import LMAblationConfig, build_lm, radial

    cfg = LMAblationConfig(hidden_size=16, num_hidden_layers=2, intermediate_size=32, seq_len=8)
    x = torch.randn(3, 16)
    none, rad = build_lm(cfg, "none", 0), build_lm(cfg, "radial", 0)
    for model, act in ((none, lambda z: z), (rad, radial)):
        mlp = model.layers[0].mlp
        assert torch.allclose(mlp(x), mlp.down_proj(act(mlp.up_proj(x))))
        assert not hasattr(mlp, "gate_proj")
    # the scaled radial is rotation-equivariant and does not saturate at entries of order 1
    z = torch.randn(5, 64, dtype=torch.float64)
    q = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64)).Q
    assert torch.allclose(radial(z @ q.T), radial(z) @ q.T)
    assert float(torch.tanh(z.norm(dim=-1) / 8).max()) < 0.99
