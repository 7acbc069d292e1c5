"""``conserve reproduce --quick``: every row carries a paper value (or 'not stated'), our value, a verdict
and a command; the report names the missing paper data sets and writes nothing silently wrong."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conserve.cli import main as cli

DATA = next((p for p in (Path(os.environ.get("CONSERVE_DATA", "/nonexistent")),
                         Path(__file__).resolve().parents[2] / "shared" / "data", Path("/work/shared/data"))
             if p.is_dir()), Path(__file__).resolve().parents[2] / "shared" / "data")
HAVE = (DATA / "mnist").is_dir() and (DATA / "wikitext-2" / "wiki.train.tokens.gz").is_file()


@pytest.mark.skipif(not HAVE, reason=f"shared data (mnist/, wikitext-2/) not at {DATA}")
def test_reproduce_quick_writes_complete_rows(tmp_path):
    out = tmp_path / "rep"
    assert cli(["reproduce", "--quick", "--data", str(DATA), "--out", str(out), "--threads", "1"]) == 0
    rec = json.loads((out / "reproduce.json").read_text())
    rows = rec["rows"]
    assert len(rows) >= 25
    sections = {r["section"] for r in rows}
    assert {"Tran et al. 2026", "Jeong, Paeng, Suh 2026", "project"} <= sections
    for r in rows:
        assert r["paper_value"] and r["paper_source"], r
        assert r["ours"] and r["ours"] != "-", r
        assert r["verdict"] in ("agree", "differs", "contradicted"), r
        assert r["command"].startswith(("conserve ", "for s in")), r
        if r["ours_stats"] is not None:  # mean +- sd over the 2 seeds (or the pooled values)
            assert r["ours_stats"]["n"] >= 2 and r["ours_stats"]["sd"] >= 0, r
    assert all(r["paper_value"] == "not stated" for r in rows if r["section"] == "project")
    claims = " ".join(r["claim"] for r in rows)
    for needle in ("sigmoid", "exponent in lr", "exponent in k", "coherence", "Res+Radial", "transformer v_proj",
                   "eps/lr is one curve"):
        assert needle in claims, needle
    sig = next(r for r in rows if "normalised-sigmoid" in r["claim"])
    assert sig["verdict"] == "contradicted"  # docs/router_sigmoid.md, measured again here
    assert set(rec["data"]["not_available"]) <= {"WikiText-103", "ImageNet"}
    md = (out / "reproduce.md").read_text()
    assert "Quick budget" in md and "| claim | paper | source | ours | verdict | basis |" in md
    if rec["data"]["not_available"]:
        assert "Not available here" in md
    assert not (out / "reproduce.partial.json").exists()


def test_reproduce_user_errors(tmp_path, capsys):
    assert cli(["reproduce", "--quick", "--only", "nope", "--out", str(tmp_path / "a")]) == 2
    assert "--only" in capsys.readouterr().err
    assert cli(["reproduce", "--quick", "--only", "mlp", "--data", str(tmp_path), "--out", str(tmp_path / "b")]) == 2
    assert "--mnist" in capsys.readouterr().err
    assert cli(["reproduce", "--quick", "--only", "lm", "--data", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert "--text" in capsys.readouterr().err


def test_reproduce_router_only_is_data_free(tmp_path):
    out = tmp_path / "r"
    assert cli(["reproduce", "--quick", "--only", "router,laws", "--data", str(tmp_path), "--out", str(out)]) == 0
    rec = json.loads((out / "reproduce.json").read_text())
    verdicts = {r["claim"].split(":")[0]: r["verdict"] for r in rec["rows"]}
    assert all(r["verdict"] == "agree" for r in rec["rows"] if "is conserved by gradient flow" in r["claim"])
    assert any("sigmoid" in c for c in verdicts) and rec["data"]["not_available"] == ["WikiText-103", "ImageNet"]


@pytest.mark.skipif(not (DATA / "wikitext-2" / "wiki.train.tokens.gz").is_file(), reason=f"WikiText-2 not at {DATA}")
def test_run_preset_wikitext2_defaults_and_explicit_flags_win(tmp_path, monkeypatch):
    monkeypatch.setenv("CONSERVE_DATA", str(DATA))
    out = tmp_path / "run"
    assert cli(["run", "--preset", "wikitext2", "--steps", "3", "--every", "1", "--layers", "2", "--batch-size", "2",
                "--seq-len", "16", "--no-progress", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["optimizer"] == "adamw" and cfg["weight_decay"] == 0.1 and cfg["lr"] == 1e-3
    assert cfg["data_source"].endswith("wikitext-2/wiki.train.tokens.gz")
    assert cfg["model"]["num_hidden_layers"] == 2 and cfg["model"]["hidden_size"] == 128  # --layers wins, size base
    summary = json.loads((out / "summary.json").read_text())
    assert "gain" in json.dumps(summary) and "decay" in json.dumps(summary)
    monkeypatch.setenv("CONSERVE_DATA", str(tmp_path / "nowhere"))
    assert cli(["run", "--preset", "wikitext2", "--steps", "1", "--out", str(tmp_path / "r2")]) == 2
