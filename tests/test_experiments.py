"""``conserve experiment scaling`` and ``conserve experiment optimizers`` end to end through the CLI, on tiny
budgets in float64 (so rounding does not pollute the small drifts), checked against the theory of the spec's
"Discrete steps" section: GD/SGD eps ~ lr^2 k; SGD first-order term zero; the heavy-ball recursion; AdamW's
first-order term dominating; the exact identity's residual at rounding level."""
from __future__ import annotations

import json
import os
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from conserve.cli import main as cli
from conserve.experiments.common import fit_pooled, fit_power, load_images, log_steps

# the shared real data: $CONSERVE_DATA, shared/ beside the clone (CI), or the workplace copy
DATA = next((p for p in (Path(os.environ.get("CONSERVE_DATA", "/nonexistent")),
                         Path(__file__).resolve().parents[2] / "shared" / "data", Path("/work/shared/data"))
             if p.is_dir()), Path(__file__).resolve().parents[2] / "shared" / "data")
MNIST = DATA / "mnist"
TINY = ["--dtype", "float64", "--hidden", "16", "--seq-len", "16", "--batch-size", "4", "--no-progress"]


# ------------------------------------------------------------------------------------------ fitting
def test_fit_power_recovers_exponent_and_pooled_ignores_prefactors():
    x = np.array([1e-3, 2e-3, 4e-3, 8e-3])
    f = fit_power(x, 3.0 * x ** 2)
    assert f["exponent"] == pytest.approx(2.0, abs=1e-12) and f["prefactor"] == pytest.approx(3.0, rel=1e-9)
    assert f["r2"] == pytest.approx(1.0)
    pooled = fit_pooled([(x, 5.0 * x ** 1.5), (x, 1e-6 * x ** 1.5), (x, [0.0, -1.0, 1.0, 0.0])])
    assert pooled["exponent"] == pytest.approx(1.5, abs=1e-12) and pooled["series"] == 2  # 3rd: < 2 positive points
    assert math.isnan(fit_power([1, 1], [1, 2])["exponent"])


def test_log_steps():
    ks = log_steps(1000)
    assert ks[0] == 1 and ks[-1] == 1000 and {10, 100} <= set(ks) and ks == sorted(set(ks))
    assert log_steps(2) == [1, 2]


# ------------------------------------------------------------------------------------------ scaling
@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory):
    if not MNIST.is_dir():
        pytest.skip(f"MNIST idx files not found at {MNIST} (CI lays shared/ beside the clone)")
    out = tmp_path_factory.mktemp("scaling")
    rc = cli(["experiment", "scaling", "--models", "lm,vit", "--images", str(MNIST), "--image-limit", "256",
              "--image-batch", "32", "--optimizers", "gd,sgd,fullgd", "--gd-subset", "16", "--steps", "12", "--fit-k", "1,12",
              "--lrs", "0.00025,0.0005,0.001,0.002", "--vit-lrs", "0.000025,0.00005,0.0001,0.0002",
              "--out", str(out), *TINY])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_scaling_exponents_match_theory(scaling_run):
    out, res = scaling_run
    assert set(res["results"]) == {"lm_gd", "lm_sgd", "lm_fullgd", "vit_gd", "vit_sgd", "vit_fullgd"}
    assert res["config"]["gd_subset"] == 16
    for name, r in res["results"].items():
        fit = r["fit"]
        assert len(fit["lrs"]) == 4 and fit["k_fixed"] == 12
        # overall, every run: 2 +- 0.15 in lr, 1 +- 0.15 in k
        assert fit["overall"]["lr_exponent"] == pytest.approx(2.0, abs=0.15), name
        assert fit["overall"]["k_exponent"] == pytest.approx(1.0, abs=0.15), name
        fams = fit["families"]
        for f in fit["fitted_families"]:
            assert fams[f]["lr_exponent"] == pytest.approx(2.0, abs=0.15), (name, f)
            if name.endswith("gd") and not name.endswith("sgd"):  # full batch: the per-step drift is the same quadratic form every step
                assert fams[f]["k_exponent"] == pytest.approx(1.0, abs=0.15), (name, f)
        # the linear laws are exactly conserved by GD/SGD: rounding only, excluded from the fits
        linear = {"router_sum", "translation"} & set(fams)
        assert linear and not linear & set(fit["fitted_families"])
        for f in linear:
            assert max(fams[f]["eps_at_k"]) < 1e-12 and "linear" in fams[f]["excluded_because"]
        assert len(fit["fitted_families"]) >= 4
    lm_fams = set(res["results"]["lm_gd"]["fit"]["families"])
    assert {"rope_pair", "qk", "vo", "swiglu", "router_sum", "gain", "translation"} <= lm_fams
    assert {"qk", "vo", "relu", "gain", "translation"} <= set(res["results"]["vit_gd"]["fit"]["families"])
    for name in res["results"]:
        assert (out / f"eps_vs_step_{name}.png").stat().st_size > 1000
        assert (out / f"eps_vs_lr_{name}.png").stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "## lm_gd" in md and "**overall**" in md and "router_sum not fitted" in md


def test_scaling_collapse_and_exponent_vs_k_from_the_runs(scaling_run):
    """The primary outputs: eps/lr vs lr*k collapse and the lr exponent at every k, recomputed here from the
    stored runs (independent least squares with numpy)."""
    out, res = scaling_run
    for name, r in res["results"].items():
        runs = r["runs"]
        lrs = sorted(runs, key=float)
        assert (out / f"collapse_{name}.png").stat().st_size > 1000
        for f in r["fit"]["fitted_families"]:
            info = r["fit"]["families"][f]
            ev, col = info["exponent_vs_k"], info["collapse"]
            assert ev["k"] == runs[lrs[0]]["steps"] and len(ev["exponent"]) == len(ev["k"])
            for i in (0, len(ev["k"]) // 2, len(ev["k"]) - 1):
                slope = np.polyfit(np.log([float(lr) for lr in lrs]), np.log([runs[lr]["eps"][f][i] for lr in lrs]), 1)[0]
                assert ev["exponent"][i] == pytest.approx(slope, abs=1e-9), (name, f, i)
            # GD at small lr k: eps/lr is one function of t = lr k to a few percent (exact at k = 1 for gd)
            assert col["t"], (name, f)
            if not name.endswith("_sgd"):  # SGD: eps at equal t comes from different minibatches (k differs)
                assert col["max_spread"] < 0.1, (name, f, col["max_spread"])
            lo, hi = col["t_range"]
            assert lo == pytest.approx(max(float(lr) * runs[lr]["steps"][0] for lr in lrs))
            assert hi == pytest.approx(min(float(lr) * runs[lr]["steps"][-1] for lr in lrs))
    md = (out / "results.md").read_text()
    assert "Collapse of eps/lr" in md and "window: k in [1, 12]" in md


def test_scaling_gd_first_step_is_exactly_quadratic(scaling_run):
    """At k = 1 GD starts from the same theta_0 for every lr: eps(1) = lr^2 |g^T M g| / |h_0| exactly, so the
    ratios eps(1, lr) / lr^2 agree to rounding (an independent check of the tracker's eps)."""
    _, res = scaling_run
    runs = res["results"]["lm_gd"]["runs"]
    for f in ("gain", "vo", "swiglu"):
        ratios = [runs[lr]["eps"][f][0] / float(lr) ** 2 for lr in runs]
        assert max(ratios) / min(ratios) == pytest.approx(1.0, abs=1e-5), f


# ---------------------------------------------------------------------------------------- optimizers
@pytest.fixture(scope="module")
def optimizers_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("optimizers")
    rc = cli(["experiment", "optimizers", "--steps", "25", "--out", str(out), *TINY])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_optimizers_identity_and_theory(optimizers_run):
    out, res = optimizers_run
    runs = res["results"]["lm"]["runs"]
    assert list(runs) == ["sgd", "sgd+wd", "momentum", "momentum+wd", "adamw", "adamw+wd"]
    quadratic = [f for f, v in runs["sgd"]["families"].items() if v["second"] > 0]
    assert {"gain", "vo", "swiglu", "rope_pair", "qk"} <= set(quadratic)
    for cfg, run in runs.items():
        for f, v in run["families"].items():
            assert v["residual_relative"] < 1e-10, (cfg, f)  # the identity holds to float64 rounding
            if cfg in ("sgd", "momentum", "adamw"):
                assert v["decay"] == 0.0, (cfg, f)
        if cfg in ("sgd+wd", "adamw+wd"):
            assert all(v["decay"] > 0 for v in run["families"].values()), cfg
    for f in quadratic:
        for cfg in ("sgd", "sgd+wd"):  # Noether: the first-order term of (coupled-L2) SGD vanishes
            assert runs[cfg]["families"][f]["first_over_second"] < 1e-6, (cfg, f)
        assert runs["sgd"]["families"][f]["measured_over_second"] == pytest.approx(1.0, abs=1e-6)
        m = runs["momentum"]["families"][f]
        assert m["recursion_relative"] < 1e-6, f  # p_k = beta (p_{k-1} + q_{k-1}) exactly
        assert 2.0 < m["measured_over_second"] < 19.0, f  # amplified, approaching (1+beta)/(1-beta) = 19
        assert runs["momentum+wd"]["families"][f]["recursion_relative"] > 1e-3, f  # coupled L2 breaks it
        assert runs["adamw"]["families"][f]["first_over_second"] > 1.0, f  # AdamW: first order dominates
    assert (out / "drift_lm.png").stat().st_size > 1000 and (out / "eps_lm.png").stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "### swiglu" in md and "(1+beta)/(1-beta) = 19" in md


# -------------------------------------------------------------------------------------- user errors
def _exit_code(argv) -> int:
    """The CLI's exit code: argparse errors exit via SystemExit, UsageErrors return 2."""
    try:
        return cli(argv)
    except SystemExit as e:
        return int(e.code)


@pytest.mark.parametrize("argv, words", [
    (["experiment", "scaling", "--models", "lm", "--lrs", "0.01"], "at least 2 distinct"),
    (["experiment", "scaling", "--models", "lm", "--lrs", "0.01,-0.02"], "positive"),
    (["experiment", "scaling", "--models", "lm", "--lrs", "a,b"], "comma-separated numbers"),
    (["experiment", "scaling", "--models", "lm,cnn"], "subset of lm,vit"),
    (["experiment", "scaling", "--models", "lm", "--steps", "10", "--fit-k", "1,20"], "exceeds --steps"),
    (["experiment", "scaling", "--models", "lm", "--fit-k", "5,5"], "LO < HI"),
    (["experiment", "scaling", "--models", "vit", "--images", "/nonexistent/mnist"], "not found"),
    (["experiment", "scaling", "--models", "lm", "--data", "/nonexistent.txt"], "not found"),
    (["experiment", "optimizers", "--momentum", "1.5"], "--momentum must be in (0, 1)"),
    (["experiment", "optimizers", "--optimizers", "sgd,lion"], "subset of"),
])
def test_user_errors_are_one_line_exit_2(argv, words, capsys, tmp_path):
    assert _exit_code(argv + ["--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and "Traceback" not in err


def test_vit_without_images_names_the_fix(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if scikit-learn were not installed
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert cli(["experiment", "scaling", "--models", "vit", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--images PATH" in err and "scikit-learn" in err and "--models lm" in err


def test_embedded_digits_when_sklearn_is_present(monkeypatch):
    """The scikit-learn digits path (8x8 images, 0..16) with a stand-in ``load_digits``."""
    rng = np.random.default_rng(0)
    fake = types.ModuleType("sklearn.datasets")
    fake.load_digits = lambda: types.SimpleNamespace(images=rng.integers(0, 17, (50, 8, 8)).astype(float),
                                                     target=rng.integers(0, 10, 50))
    monkeypatch.setitem(sys.modules, "sklearn", types.ModuleType("sklearn"))
    monkeypatch.setitem(sys.modules, "sklearn.datasets", fake)
    x, y, source = load_images(None)
    assert x.shape == (50, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.long
    assert "digits" in source and abs(float(x.mean())) < 1e-5 and float(x.std()) == pytest.approx(1.0, abs=1e-2)


def test_cifar_images(tmp_path):
    cifar = DATA / "cifar10" / "cifar10_train_1000.bin.gz"
    if not cifar.is_file():
        pytest.skip(f"CIFAR-10 subset not found at {cifar}")
    x, y, source = load_images(cifar, limit=64)
    assert x.shape == (64, 3, 32, 32) and y.shape == (64,) and "CIFAR-10" in source
