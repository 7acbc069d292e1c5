"""Per-channel laws of convolutional nets (``docs/laws.md``, "Convolutions"): torch.nn detection of
Conv-ReLU-Conv balances, channel Gram laws, norm gains and the scale laws of a conv before an eps = 0 norm, the
channel builders (``conserve.detection.builders.ChannelMap``), and the declines (BatchNorm, GELU, the output).

Every claimed law passes ``conserve.verify`` (float64 first-order check and symmetry check); planted wrong laws
(the ones a naive reading would give) fail the first-order check by orders of magnitude."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import conserve
from conserve.analysis.verify import TOL, first_order
from conserve.detection import builders, detect
from conserve.laws import DeepLinearGram, NormScaleLaw, ReLUUnit, evaluate_laws

WRONG = 1e-6


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """float64, every parameter N(0, 0.5^2) (+1 for 1-D weights: norm gains), random BatchNorm statistics."""
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5
                    + (1.0 if p.dim() == 1 and name.endswith("weight") else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype))
            elif name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=g, dtype=b.dtype) + 0.5)
    return model


def images(c: int, *size: int, n: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, c, *size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def assert_verified(model, laws, x):
    assert laws
    bad = {ch.law: (ch.first_order, ch.symmetry) for ch in conserve.verify(model, laws, x) if not ch.ok}
    assert not bad, bad


def reasons(found) -> dict[str, str]:
    return {d.module: d.block + ": " + d.reason for d in found.declined}


def law(found, name):
    return next(x for x in found.laws if x.name == name)


# ------------------------------------------------------------------------------------------- models
def lenet() -> nn.Sequential:
    """LeNet-5 on 1 x 28 x 28 (padding 2 on the first conv), ReLU and max-pooling."""
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84),
                         nn.ReLU(), nn.Linear(84, 10))


def vgg_block(eps: float = 1e-5) -> nn.Sequential:
    """Two VGG stages (Conv-BN-ReLU x2 + max-pool; a grouped conv, GroupNorm, a 1x1 conv) and a linear head."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, groups=2), nn.GroupNorm(4, 16, eps=eps), nn.ReLU(),
                      nn.Conv2d(16, 16, 1), nn.LeakyReLU(0.1), nn.AdaptiveAvgPool2d(1)),
        nn.Flatten(), nn.Linear(16, 10))


# ------------------------------------------------------------------------------------------ tests
def test_lenet_conv_relu_conv_and_conv_flatten_linear():
    m = randomize(lenet())
    d = detect(m)
    assert d.detector == "torch.nn" and d.undetected == []
    assert d.families() == {"relu": 4}
    assert [x.size for x in d.laws] == [6, 16, 120, 84]
    assert "loss='ce'" in reasons(d)["11"]
    assert_verified(m, d.laws, images(1, 28, 28, n=2))


def test_lenet_law_values_are_the_channel_norms():
    """The pieces of a channel add up to its kernel slice: the law's value (kernels' reference path) is
    ``||W1[c]||^2 + b1[c]^2 - ||W2[:, c]||^2`` (Conv-ReLU-Conv) and the flattened block of the Linear."""
    m = randomize(lenet())
    d = detect(m)
    p = dict(m.named_parameters())
    got = evaluate_laws(d.laws, p, fp64=True)
    w1, b1, w2 = p["0.weight"], p["0.bias"], p["3.weight"]
    want = w1.pow(2).sum((1, 2, 3)) + b1.pow(2) - w2.pow(2).sum((0, 2, 3))
    torch.testing.assert_close(got["0-3/unit"], want)
    fc = p["7.weight"].reshape(120, 16, 25)
    want = p["3.weight"].pow(2).sum((1, 2, 3)) + p["3.bias"].pow(2) - fc.pow(2).sum((0, 2))
    torch.testing.assert_close(got["3-7/unit"], want)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_vgg_block_norm_gains_hold_in_train_and_eval_mode(train):
    m = randomize(vgg_block(eps=0.0)).train(train)
    d = detect(m)
    assert d.families() == {"gain": 3, "norm_scale": 1, "relu": 1}, d.families()
    assert d.undetected == []
    r = reasons(d)
    for conv in ("0.0", "0.3"):  # conv before BatchNorm: declined, the reason says what was seen
        assert "BatchNorm2d" in r[conv] and "running_mean" in r[conv] and "eps=1e-05" in r[conv]
    scale = law(d, "1.0/norm_scale")
    assert isinstance(scale, NormScaleLaw) and scale.size == 4  # one per GroupNorm group
    assert law(d, "0.4/gain").size == 8  # read by the grouped conv 1.0 through ReLU and max-pool
    assert_verified(m, d.laws, images(3, 8, 8))


def test_groupnorm_with_eps_declines_the_scale_law():
    m = randomize(vgg_block(eps=1e-5))
    d = detect(m)
    assert "norm_scale" not in d.families()
    assert "GroupNorm" in reasons(d)["1.0"] and "eps=1e-05" in reasons(d)["1.0"] and "group" in reasons(d)["1.0"]
    x = images(3, 8, 8)
    # the law is really only approximate: the check sees the eps (exact for eps = 0 above)
    exact = detect(randomize(vgg_block(eps=0.0)))
    assert 1e-12 < first_order(m, law(exact, "1.0/norm_scale"), x) < 1e-4


def test_more_layouts():
    """Conv1d, Conv3d, ConvTranspose2d, depthwise-separable, channel Gram through average pooling / padding /
    upsampling, LayerNorm over (C, H, W) and InstanceNorm with eps = 0."""
    cases = {
        "conv1d": (nn.Sequential(nn.Conv1d(2, 5, 3), nn.LeakyReLU(0.2), nn.Dropout(0.0), nn.Conv1d(5, 3, 3)),
                   images(2, 9), {"relu": 1}),
        "conv3d": (nn.Sequential(nn.Conv3d(2, 4, 2), nn.ReLU(), nn.MaxPool3d(2), nn.Conv3d(4, 3, 1)),
                   images(2, 5, 5, 5), {"relu": 1}),
        "transpose": (nn.Sequential(nn.ConvTranspose2d(3, 4, 2, stride=2), nn.ReLU(), nn.ConvTranspose2d(4, 6, 3, groups=2),
                                    nn.ReLU(), nn.Conv2d(6, 2, 1)),
                      images(3, 4, 4), {"relu": 2}),
        "depthwise": (nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.ReLU(), nn.Conv2d(4, 8, 1), nn.ReLU(),
                                    nn.Conv2d(8, 8, 3, groups=4, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1)),
                      images(4, 6, 6), {"relu": 3}),
        "gram": (nn.Sequential(nn.Conv2d(3, 4, 3), nn.AvgPool2d(2), nn.ZeroPad2d(1), nn.Upsample(scale_factor=2),
                               nn.ReflectionPad2d(1), nn.Conv2d(4, 5, 3), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                               nn.Linear(20, 3)),
                 images(3, 8, 8), {"deep_linear": 2}),
        "layernorm": (nn.Sequential(nn.Conv2d(2, 3, 3), nn.LayerNorm([3, 4, 4], eps=0.0), nn.ReLU(), nn.Conv2d(3, 2, 3)),
                      images(2, 6, 6), {"gain": 1, "norm_scale": 1}),
        "instancenorm": (nn.Sequential(nn.Conv2d(2, 3, 3), nn.InstanceNorm2d(3, affine=True, eps=0.0), nn.ReLU(),
                                       nn.Conv2d(3, 2, 3)),
                         images(2, 6, 6), {"gain": 1, "norm_scale": 1}),
    }
    for name, (m, x, fams) in cases.items():
        m = randomize(m)
        d = detect(m, example_inputs=x)  # the module-type laws are checked on the model's own forward
        assert d.families() == fams, (name, d.families(), reasons(d))
        assert d.undetected == [], name
        assert_verified(m, d.laws, x)
    # the channel Gram through linear per-channel maps is C x C (GL(C) mixing, not only rescaling)
    assert law(d, "1/gain").size == 3 and law(d, "0/norm_scale").size == 3  # InstanceNorm: per channel
    gram = detect(randomize(cases["gram"][0]))
    assert [x.size for x in gram.laws] == [4, 5] and all(isinstance(x, DeepLinearGram) for x in gram.laws)


def test_planted_wrong_laws_fail():
    x = images(3, 8, 8)
    m = randomize(vgg_block(eps=0.0))
    d = detect(m)
    conv = builders.ChannelMap.of
    bad = {
        # Conv-ReLU-Conv read across the BatchNorm (its batch statistics absorb the rescaling)
        "across BN": builders.channel_unit_law(ReLUUnit, "bad", 0, conv("0.3", m[0][3]), conv("1.0", m[1][0])),
        # the GroupNorm scale law per channel instead of per group of 4
        "per channel": builders.channel_scale_law("bad", 1, conv("1.0", m[1][0]), [[c] for c in range(16)]),
        # the gain law without the norm's bias
        "no beta": dataclasses.replace(law(d, "0.4/gain"), terms=[t for t in law(d, "0.4/gain").terms
                                                                  if t.ref.param != "0.4.bias"]),
    }
    for what, wrong in bad.items():
        assert first_order(m, wrong, x) > WRONG, what
    # the channel Gram through ReLU (only the per-channel rescaling passes it)
    relu = randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)))
    gram = builders.channel_gram_law(DeepLinearGram, "bad", 0, conv("0", relu[0]), conv("2", relu[2]))
    assert first_order(relu, gram, x) > WRONG


def test_declines_name_what_was_seen():
    m = randomize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.GELU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.Tanh(),
                                nn.Conv2d(4, 2, 1), nn.ReLU()))
    d = detect(m)
    r = reasons(d)
    assert d.laws == [] and d.undetected == []
    assert "Conv2d-GELU" in r["0"] and "no continuous rescaling symmetry" in r["0"]
    assert "BatchNorm2d" in r["2"]
    assert "Tanh" in r["3"]  # the BatchNorm gain is followed by tanh: no gain law
    assert "model's output" in r["5"] and "ReLU" in r["5"]


def test_bn_laws_measured():
    """The spec's BatchNorm statements, measured: (train) the conv channel before BN is scale invariant only
    up to eps; (eval) ``||W[c]||^2 + (b[c] - running_mean[c])^2 - gamma[c]^2`` is exact; the gain law is exact
    in both modes."""
    m = randomize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 3)))
    x = images(3, 6, 6)
    bn = m[1]

    def scale(p):
        return p["0.weight"].pow(2).sum((1, 2, 3)) + p["0.bias"].pow(2)

    def eval_law(p):
        return p["0.weight"].pow(2).sum((1, 2, 3)) + (p["0.bias"] - bn.running_mean).pow(2) - p["1.weight"].pow(2)

    def relu_law(p):  # the Conv-ReLU-Conv law read across the norm
        return scale(p) - p["3.weight"].pow(2).sum((0, 2, 3))

    m.train()
    assert 1e-12 < first_order(m, scale, x) < 1e-5
    assert first_order(m, relu_law, x) > WRONG
    m.eval()
    assert first_order(m, eval_law, x) < TOL
    assert first_order(m, scale, x) > WRONG and first_order(m, relu_law, x) > WRONG
    for mode in (True, False):
        d = detect(m.train(mode))
        assert d.families() == {"gain": 1}
        assert first_order(m, d.laws[0], x) < TOL


def test_channel_map_pieces():
    """Pieces cover each channel's slice exactly once, grouped and transposed layouts included."""
    for shape, groups, transposed in [((8, 3, 3, 3), 1, False), ((8, 2, 3, 3), 4, False), ((4, 3, 2, 2), 2, True),
                                      ((6, 5), 1, False)]:
        w = torch.randn(shape, dtype=torch.float64)
        m = builders.ChannelMap("w", shape, groups=groups, transposed=transposed)
        full = nn.functional.conv_transpose2d if transposed else None
        for side, n in (("out", m.out_channels), ("in", m.in_channels)):
            pieces = m.out_pieces() if side == "out" else m.in_pieces()
            got = torch.zeros(n, dtype=torch.float64)
            for e, ref in pieces:
                got[e: e + ref.rows] += ref.view(0).of(w).pow(2).sum(1)
            want = torch.zeros(n, dtype=torch.float64)
            for c in range(n):  # the entries of w that write (out) / read (in) channel c, from the definition
                if side == "out":
                    sl = w[c] if not transposed else w[(c // (n // groups)) * (shape[0] // groups):
                                                       (c // (n // groups) + 1) * (shape[0] // groups), c % shape[1]]
                else:
                    sl = w[c] if transposed else w[(c // shape[1]) * (shape[0] // groups):
                                                   (c // shape[1] + 1) * (shape[0] // groups), c % shape[1]]
                want[c] = sl.pow(2).sum()
            torch.testing.assert_close(got, want, msg=f"{shape} {groups} {transposed} {side}")
        del full


def test_lenet_laws_are_tracked_with_the_gd_drift_identity():
    """conserve.track on the detected CNN laws: each law moves by exactly ``lr^2 g^T M g`` per SGD step (spec:
    drift identity; the first-order term vanishes), and the tracker's values are the laws' values."""
    import torch.nn.functional as F

    m = randomize(lenet())
    lr = 1e-3
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=lr), m, fp64=True, snapshot_budget=None, drift_every=1)
    tr = opt.tracker
    assert {x.family for x in tr.laws} == {"relu"}
    x, y = images(1, 28, 28, n=4), torch.tensor([1, 3, 5, 7])
    for _ in range(3):
        before = {k: v.clone() for k, v in tr.values().items()}
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        step = {n: lr * p.grad for n, p in m.named_parameters()}
        opt.step()
        pred = evaluate_laws(tr.laws, step, fp64=True)
        now = tr.values()
        exact = evaluate_laws(tr.laws, dict(m.named_parameters()), fp64=True)
        for x_ in tr.laws:
            torch.testing.assert_close(now[x_.name].double(), exact[x_.name], rtol=1e-9, atol=1e-12)
            change = now[x_.name].double() - before[x_.name].double()
            scale = exact[x_.name].abs().max().item()
            torch.testing.assert_close(change, pred[x_.name], rtol=1e-6, atol=1e-9 * scale)
