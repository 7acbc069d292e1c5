"""What a user touches first: the names ``conserve`` exports, ``track``'s detection options, and where its
warnings point."""
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import conserve
import conserve.errors


@pytest.mark.parametrize("name", ["NonFiniteError", "StaleParameterError", "DivergenceError", "UsageError",
                                  "UnsupportedModelError"])
def test_the_errors_are_exported(name):
    assert getattr(conserve, name) is getattr(conserve.errors, name)
    assert name in conserve.__all__ and name in dir(conserve)


def test_dir_is_the_public_names_and_import_stays_lazy():
    code = ("import sys, conserve; names = dir(conserve); "
            "print(sorted(n for n in names if not n.startswith('__'))); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.splitlines()
    names = eval(out[0])  # noqa: S307 - our own printout
    assert "annotations" not in names and "importlib" not in names
    assert {"track", "Tracker", "NonFiniteError", "StaleParameterError"} <= set(names)
    assert set(names) == set(conserve.__all__)
    assert out[1] == "False"  # dir() imports nothing


class TwoInputs(nn.Module):
    """forward needs a second argument: its input cannot be synthesised."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x, scale):
        return self.fc2(torch.relu(self.fc1(x))) * scale


def test_track_passes_example_inputs_to_detection():
    torch.manual_seed(0)
    m = TwoInputs()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(conserve.UnsupportedModelError, match="example_inputs"):
        conserve.track(opt, m)
    tracked = conserve.track(opt, m, example_inputs=(torch.randn(4, 6), 2.0))
    assert tracked.tracker.families == ["relu"] and len(tracked.tracker.laws) == 1
    with pytest.raises(ValueError, match="laws= is given"):
        conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, laws=tracked.tracker.laws,
                       example_inputs=(torch.randn(4, 6), 2.0))


def test_a_warning_inside_the_step_points_at_the_users_line():
    torch.manual_seed(0)
    m = TwoInputs()
    opt = conserve.track(torch.optim.SGD(m.parameters(), lr=0.1), m, every=2, example_inputs=(torch.randn(4, 6), 1.0))
    x = torch.randn(4, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            m(x, 1.0).sum().backward()
            opt.step(); line = sys._getframe().f_lineno  # noqa: E702 - the line the warning names
            with torch.no_grad():
                m.fc1.weight.mul_(1.01)  # changed outside the tracked step: warned at the next step
    got = [w for w in caught if "changed in place" in str(w.message)]
    assert len(got) == 1
    assert (got[0].filename, got[0].lineno) == (__file__, line)
