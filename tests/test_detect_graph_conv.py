"""Structural detection of convolution laws (``conserve.detection.match.conv``) in forward code no type-based detector
reads: a CNN written as its own module, with ``F.relu`` / ``F.max_pool2d`` / ``F.avg_pool2d`` between convolutions,
``F.conv2d`` of a parameter, a BatchNorm / GroupNorm read by the next convolution, a flatten into a classifier.
Every claimed law passes the first-order check on the ORIGINAL model (``test_detect_graph.hold``); planted wrong
laws fail it; a channel read twice (a residual) is not claimed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conserve.detection import builders, detect
from conserve.laws import ReLUUnit, Term
from test_detect_graph import fail, hold, law, reasons
from test_detect_torch import randomize


class CNN(nn.Module):
    """conv -> ReLU -> max-pool -> conv (or ``F.conv2d`` of a parameter) -> norm -> ReLU -> 1x1 conv -> avg-pool ->
    flatten -> Linear; ``residual``: the first conv's output also added back (read twice)."""

    def __init__(self, norm="bn", functional=False, residual=False):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(12) if norm == "bn" else nn.GroupNorm(3, 12)
        self.c3 = nn.Conv2d(12, 6, 1)
        self.fc = nn.Linear(6 * 9, 5)
        self.functional, self.residual = functional, residual
        if functional:
            self.w2 = nn.Parameter(torch.randn(12, 8, 3, 3) * 0.2)
        else:
            self.c2 = nn.Conv2d(8, 12, 3)

    def forward(self, x):
        h = F.relu(self.c1(x))
        if self.residual:
            h = h + self.c1(x)
        h = F.max_pool2d(h, 2)
        h = F.conv2d(h, self.w2) if self.functional else self.c2(h)
        h = F.relu(self.norm(h))
        h = F.avg_pool2d(self.c3(h), 2)
        return self.fc(h.flatten(1))


def images():
    return torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("norm", ["bn", "gn"])
@pytest.mark.parametrize("functional", [False, True])
def test_cnn_channel_laws(norm, functional):
    m = randomize(CNN(norm, functional)).eval()
    x = images()
    found = detect(m, example_inputs=x, loss="ce")
    assert found.detector == "graph" and found.undetected == [], (found.detector, found.undetected)
    c2, w2 = ("w2", "w2") if functional else ("c2", "c2.weight")
    assert {l.name for l in found.laws} == {f"c1-{c2}/unit", "c3-fc/gram", "norm/gain", "fc/translation"}
    assert law(found, f"c1-{c2}/unit").params == ("c1.weight", "c1.bias", w2)  # ReLU, max-pool between
    assert law(found, "c3-fc/gram").family == "deep_linear"  # average pooling and flatten mix no channels
    assert law(found, "norm/gain").params == ("norm.weight", "norm.bias", "c3.weight")
    if not functional:
        assert "before" in reasons(found)["c2"] and "normalised by 'norm'" in reasons(found)["c2"]
    hold(m, found, x)
    # the same law with the channels of the reader shifted by one fails
    up = builders.ChannelMap("c1.weight", (8, 3, 3, 3), "c1.bias")
    down = builders.ChannelMap(w2, (12, 8, 3, 3))
    terms = [Term("norm", r, +1.0, offset=e) for e, r in up.out_pieces(0, 7)] + \
        [Term("norm", r, -1.0, offset=e) for e, r in down.in_pieces(1, 7)]  # channel c against reader channel c + 1
    shifted = ReLUUnit("shifted", None, terms, 7)
    fail(m, {"shifted channels": shifted}, x)


def test_channels_read_twice_are_not_claimed():
    m = randomize(CNN(residual=True)).eval()
    x = images()
    found = detect(m, example_inputs=x, loss="ce")
    assert not any(l.params[0] == "c1.weight" for l in found.laws)
    assert "c1" in reasons(found) and found.undetected == []
    hold(m, found, x)


class ChannelsLastNormBlock(nn.Module):
    """ConvNeXt's block with ``conv_mlp``: a depthwise conv, timm's ``LayerNorm2d`` (``layer_norm`` over the
    channels of ``x.permute(0, 2, 3, 1)``, permuted back) and 1 x 1 convolutions."""

    def __init__(self, c=6):
        super().__init__()
        self.conv_dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Conv2d(c, 4 * c, 1), nn.Conv2d(4 * c, c, 1)
        self.gamma = nn.Parameter(torch.ones(c))

    def forward(self, x):
        h = self.conv_dw(x)
        h = F.layer_norm(h.permute(0, 2, 3, 1), (h.shape[1],), self.norm.weight, self.norm.bias).permute(0, 3, 1, 2)
        return x + self.fc2(F.gelu(self.fc1(h))).mul(self.gamma.reshape(1, -1, 1, 1))


def test_a_channels_last_layer_norm_permuted_back_gets_the_channel_gain_law():
    """The gain scales channel c of the permuted-back output, which only fc1's input channel c reads: the
    channel gain law (norm weight and bias, fc1's input channels) holds; the depthwise conv before it is declined.
    ``gamma`` scales fc2's output channels (LayerScale): ``gamma_c^2 - ||W_fc2[c]||^2 - b_fc2[c]^2``; fc1 reaches
    fc2 through a GELU (declined)."""
    m = randomize(ChannelsLastNormBlock())
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    found = detect(m, example_inputs=x, structural=True)
    assert found.families() == {"gain": 1, "layer_scale": 1} and found.undetected == [], found.families()
    gain = law(found, "norm/gain")
    assert set(gain.params) == {"norm.weight", "norm.bias", "fc1.weight"}, gain.params
    assert set(law(found, "gamma/layer_scale").params) == {"gamma", "fc2.weight", "fc2.bias"}
    r = reasons(found)
    assert "channels-last LayerNorm" in r["conv_dw"] and "not positively homogeneous" in r["fc1"]
    hold(m, found, x)
    no_bias = builders.channel_layer_scale_law("no bias", 0, "gamma", builders.ChannelMap("fc2.weight", (6, 24, 1, 1)))
    fail(m, {"without fc2's bias": no_bias}, x)


class LoudSE(nn.Module):
    """A squeeze-excitation block (``torchvision.ops.SqueezeExcitation``: pool, 1 x 1 conv, activation, 1 x 1 conv,
    sigmoid gate) whose input is large, as deep in a probed EfficientNet: SiLU is then the identity to rounding on
    the recorded values, where a channel rescaling passes it."""

    def __init__(self, act):
        super().__init__()
        self.fc1, self.fc2, self.act, self.head = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1), act, nn.Linear(8, 3)
        with torch.no_grad():
            self.fc1.bias.fill_(0.0)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1) * 500.0
        x = x * torch.sigmoid(self.fc2(self.act(self.fc1(s))))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("act", [nn.SiLU(inplace=True), nn.GELU(), nn.ReLU()], ids=["silu", "gelu", "relu"])
def test_a_channel_law_is_not_read_off_activations_saturated_at_the_probe(act):
    """The positive-rescaling test runs on unit normal values too: SiLU / GELU get no unit law, ReLU keeps it."""
    m = randomize(LoudSE(act)).eval()
    with torch.no_grad():
        m.fc1.weight.abs_()  # the probe's recorded pre-activations all large and positive
    x = torch.randn(2, 8, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).abs() + 1.0
    found = detect(m, example_inputs=x, structural=True)
    units = [l for l in found.laws if l.family == "relu"]
    assert len(units) == (1 if isinstance(act, nn.ReLU) else 0), (found.families(), reasons(found))
    hold(m, found, x)


class ClipBlock(nn.Module):
    """MobileNet's conv -> BatchNorm -> ReLU6 -> 1 x 1 conv on small inputs: no unit reaches the clip at the probe."""

    def __init__(self, act):
        super().__init__()
        self.c1, self.bn, self.act, self.c2 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), act, nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c2(self.act(self.bn(self.c1(x))))


@pytest.mark.parametrize("act", [nn.ReLU6(inplace=True), nn.Hardtanh(0.0, 6.0), nn.ReLU()], ids=["relu6", "hardtanh", "relu"])
def test_a_gain_law_is_not_read_through_a_clip_the_probe_never_reaches(act):
    m = randomize(ClipBlock(act)).eval()
    x = 0.01 * torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    found = detect(m, example_inputs=x, structural=True)
    assert ("bn/gain" in {l.name for l in found.laws}) == isinstance(act, nn.ReLU), (found.families(), reasons(found))
    hold(m, found, x)
