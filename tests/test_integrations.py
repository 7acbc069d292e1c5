"""HF Trainer and Lightning with nothing but conserve's callback: the metrics reach the framework's
logs, the tracker state follows the framework's checkpoints, rows are flushed at the end."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conserve.errors import UsageError


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------- HF
def _hf():
    try:
        import transformers
        from transformers import Trainer, TrainingArguments  # noqa: F401
        from transformers.utils import is_accelerate_available
    except Exception as e:  # noqa: BLE001 - absent, or broken by its own dependencies
        pytest.skip(f"transformers Trainer unavailable: {e}")
    if not is_accelerate_available():
        pytest.skip("the Trainer needs accelerate (pip install 'torch-conserve[hf]')")
    return transformers


class _TokenData(torch.utils.data.Dataset):
    def __init__(self, n=40, t=8, vocab=17, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, t), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _hf_trainer(out, callbacks, max_steps=10, report_to="none", **args):
    T = _hf()
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                        intermediate_size=12, num_hidden_layers=2, vocab_size=17)
    model = T.LlamaForCausalLM(cfg)
    targs = T.TrainingArguments(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
                                learning_rate=1e-2, weight_decay=0.1, logging_steps=2, save_steps=5,
                                save_strategy="steps", report_to=report_to, use_cpu=True, disable_tqdm=True,
                                dataloader_num_workers=0, seed=0, **args)
    return T.Trainer(model=model, args=targs, train_dataset=_TokenData(), callbacks=callbacks)


def test_hf_trainer_logs_checkpoints_and_resumes(tmp_path):
    from conserve.integrations.hf import ConserveCallback

    cb = ConserveCallback(drift_every=4)
    trainer = _hf_trainer(tmp_path, [cb], report_to=["tensorboard"])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "conserve/eps/vo" in h]
    assert [h["step"] for h in logged] == [2, 4, 6, 8, 10]
    assert all(h["conserve/step"] == h["step"] for h in logged)
    assert all(math.isfinite(h["conserve/eps/vo"]) for h in logged)
    # drift columns: the latest decomposition of each (drift steps 1, 5, 9 with the default cadence),
    # logged once, finite, at or before the logging step
    drift = [h for h in logged if "conserve/drift_step" in h]
    assert drift and all(h["conserve/drift_step"] <= h["step"] for h in drift)
    assert all(math.isfinite(v) for h in drift for k, v in h.items() if k.startswith("conserve/drift/"))
    assert not any(k.startswith("conserve/eps/vo/layer") for h in logged for k in h)  # family keys only
    # report_to got them too: the TensorBoard integration ran after the callback's on_log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = [EventAccumulator(str(p.parent)).Reload() for p in tmp_path.rglob("events.out.tfevents.*")]
    tags = {t for e in ev for t in e.Tags()["scalars"]}
    assert "train/conserve/eps/vo" in tags
    # every row flushed at the end to the default JSONL sink, and the tracker state is in the checkpoints
    jsonl = tmp_path / "conserve" / "metrics.jsonl"
    full = _rows(jsonl)
    assert [r["step"] for r in full] == list(range(1, 11))
    assert [r["step"] for r in full if "loss" in r] == [2, 4, 6, 8, 10]  # the Trainer's logged loss
    assert full[1]["loss"] == pytest.approx(trainer.state.log_history[0]["loss"])
    assert (tmp_path / "checkpoint-5" / "conserve_tracker.pt").is_file()
    assert cb.tracker._closed

    # resume from step 5: the series continues, no step is written twice, values match the first run
    cb2 = ConserveCallback(drift_every=4)
    trainer2 = _hf_trainer(tmp_path, [cb2])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert any("cut off" in str(x.message) for x in w)  # rows 6..10 of the first run were dropped
    again = _rows(jsonl)
    assert [r["step"] for r in again] == list(range(1, 11))
    assert cb2.tracker.step_count == 10
    for a, b in zip(full[5:], again[5:]):
        assert b["eps/vo"] == pytest.approx(a["eps/vo"], rel=1e-4, abs=1e-7)
    logged2 = [h for h in trainer2.state.log_history if "conserve/eps/vo" in h]
    assert [h["conserve/step"] for h in logged2 if h["step"] > 5] == [6, 8, 10]
    # the decomposition of step 5, first logged at step 6 (after the checkpoint), is logged there again
    drift_at = lambda hs: [(h["step"], h.get("conserve/drift_step")) for h in hs if h["step"] > 5]  # noqa: E731
    assert drift_at(logged2) == drift_at(logged) == [(6, 5.0), (8, None), (10, 9.0)]


def test_hf_resume_from_a_truncated_tracker_state_names_the_file(tmp_path):
    """User report: a truncated conserve_tracker.pt crashed in torch.load with ``OSError: [Errno 22]
    Invalid argument``, naming neither the file nor the fix."""
    from conserve.errors import UsageError
    from conserve.integrations.hf import ConserveCallback

    _hf_trainer(tmp_path, [ConserveCallback()], max_steps=5).train()
    saved = tmp_path / "checkpoint-5" / "conserve_tracker.pt"
    saved.write_bytes(saved.read_bytes()[:100])
    with pytest.raises(UsageError, match=r"cannot read the tracker state .*conserve_tracker\.pt.*delete it"):
        _hf_trainer(tmp_path, [ConserveCallback()], max_steps=6).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    torch.save({"step": "garbled"}, saved)  # readable, but not a tracker state
    with pytest.raises(UsageError, match=r"conserve_tracker\.pt: tracker state is not one saved"):
        _hf_trainer(tmp_path, [ConserveCallback()], max_steps=6).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-5"))


def test_hf_callback_uses_a_tracker_the_user_made(tmp_path):
    import conserve
    from conserve.integrations.hf import ConserveCallback

    trainer = _hf_trainer(tmp_path, [ConserveCallback(sinks=[])], max_steps=4)
    sink = conserve.MemorySink()
    opt = conserve.track(torch.optim.AdamW(trainer.model.parameters(), lr=1e-2), trainer.model, every=50,
                         sinks=[sink])
    trainer.optimizer = opt
    trainer.train()
    assert opt.tracker.step_count == 4  # booked once per step, not twice
    assert [r["step"] for r in sink.records] == [1, 2, 3, 4]
    assert [h["conserve/step"] for h in trainer.state.log_history if "conserve/step" in h] == [2, 4]
    opt.close()


def test_hf_gradient_accumulation_books_one_row_per_optimizer_step(tmp_path):
    """Gradient accumulation with global-norm clipping and a warmup + cosine schedule: one row per optimizer
    step, no law marked broken (one clipping factor and one lr for every group), and a resume from
    checkpoint-5 continues the series with the uninterrupted run's values."""
    from conserve.integrations.hf import ConserveCallback

    opts = dict(gradient_accumulation_steps=2, max_grad_norm=0.05, lr_scheduler_type="cosine", warmup_steps=2)
    cb = ConserveCallback(layers=True)
    trainer = _hf_trainer(tmp_path, [cb], max_steps=6, **opts)
    trainer.train()
    assert cb.tracker.step_count == 6
    assert not [n for n in cb.tracker.broken_by if not n.endswith("/gain")]  # (the Trainer decays no norm weight)
    logged = [h for h in trainer.state.log_history if "conserve/step" in h]
    assert [h["conserve/step"] for h in logged] == [2, 4, 6]
    assert "conserve/eps/vo/layer1" in logged[0]
    jsonl = tmp_path / "conserve" / "metrics.jsonl"
    full = _rows(jsonl)
    cb2 = ConserveCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _hf_trainer(tmp_path, [cb2], max_steps=6, **opts).train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    again = _rows(jsonl)
    assert [r["step"] for r in again] == list(range(1, 7)) and cb2.tracker.step_count == 6
    assert again[5]["eps/vo"] == pytest.approx(full[5]["eps/vo"], rel=1e-4, abs=1e-7)


# ------------------------------------------------------------------------------------ Lightning
def _lightning():
    errors = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return __import__(name, fromlist=["Trainer"])
        except Exception as e:  # noqa: BLE001 - absent, or broken by its own dependencies
            errors.append(f"{name}: {type(e).__name__}: {e}")
    pytest.skip(f"lightning does not import (absent: pip install 'torch-conserve[lightning]'; or broken by its "
                f"dependencies): {errors[0][:200]}")


def _lit_module(L):
    class Tiny(L.LightningModule):  # a 4 -> 8 -> 3 ReLU MLP
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

        def train_dataloader(self):  # 5 batches an epoch: the step-5 checkpoint is at an epoch boundary
            g = torch.Generator().manual_seed(0)
            ds = torch.utils.data.TensorDataset(torch.randn(20, 4, generator=g), torch.randint(0, 3, (20,), generator=g))
            return torch.utils.data.DataLoader(ds, batch_size=4)

    return Tiny()


def _lit_trainer(L, root, cb, max_steps, ckpt=None):
    callbacks = [cb] + ([ckpt] if ckpt is not None else [])
    return L.Trainer(default_root_dir=str(root), max_steps=max_steps, log_every_n_steps=2, accelerator="cpu",
                     devices=1, logger=L.loggers.CSVLogger(str(root), name="csv", version=0), callbacks=callbacks,
                     enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=ckpt is not None)


def test_lightning_resume_from_a_corrupt_tracker_state_is_one_error(tmp_path):
    """A garbled tracker state in a Lightning checkpoint: one UsageError naming the entry and a fix that
    applies to Lightning (it raised KeyError 'step' before)."""
    L = _lightning()
    from conserve.errors import UsageError
    from conserve.integrations.lightning import ConserveCallback

    ckpt = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=5, save_top_k=-1)
    _lit_trainer(L, tmp_path, ConserveCallback(), 5, ckpt).fit(_lit_module(L))
    path = next((tmp_path / "ck").glob("*.ckpt"))
    saved = torch.load(path, weights_only=False)
    (key,) = [k for k in saved["callbacks"] if "ConserveCallback" in k]
    saved["callbacks"][key] = {"tracker": {}}
    torch.save(saved, path)
    with pytest.raises(UsageError, match="checkpoint's tracker state cannot be loaded.*lacks.*fit without ckpt_path"):
        _lit_trainer(L, tmp_path, ConserveCallback(), 6).fit(_lit_module(L), ckpt_path=str(path))


def test_lightning_logs_checkpoints_and_resumes(tmp_path):
    L = _lightning()
    import csv

    from conserve.integrations.lightning import ConserveCallback

    ckpt = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=5, save_top_k=-1)
    cb = ConserveCallback(drift_every=4)
    trainer = _lit_trainer(L, tmp_path, cb, 10, ckpt)
    trainer.fit(_lit_module(L))
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        table = [r for r in csv.DictReader(f) if r.get("conserve/eps/relu")]
    assert [int(float(r["conserve/step"])) for r in table] == [2, 4, 6, 8, 10]
    assert all(math.isfinite(float(r["conserve/eps/relu"])) for r in table)
    assert "conserve/loss" in table[0] and float(table[0]["conserve/loss"]) > 0  # the step's loss, recorded
    jsonl = Path(trainer.log_dir) / "conserve" / "metrics.jsonl"
    full = _rows(jsonl)
    assert [r["step"] for r in full] == list(range(1, 11))  # flushed at the end
    assert cb.tracker._closed

    cb2 = ConserveCallback(drift_every=4)
    trainer2 = _lit_trainer(L, tmp_path, cb2, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer2.fit(_lit_module(L), ckpt_path=str(tmp_path / "ck" / "epoch=0-step=5.ckpt"))
    again = _rows(jsonl)
    assert [r["step"] for r in again] == list(range(1, 11))
    for a, b in zip(full[5:], again[5:]):
        assert b["eps/relu"] == pytest.approx(a["eps/relu"], rel=1e-4, abs=1e-7)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        resumed = [r for r in csv.DictReader(f) if r.get("conserve/step")]
    # the logs continue too: step 5's decomposition (logged at step 6, after the checkpoint) is logged again
    assert [(int(float(r["conserve/step"])), r["conserve/drift_step"]) for r in resumed][-3:] == \
        [(6, "5.0"), (8, ""), (10, "9.0")]


@pytest.mark.parametrize("step_every", [1, 3])
def test_lightning_manual_optimization_logs_each_row_and_drift_once(tmp_path, step_every):
    """``automatic_optimization = False``: the drift columns (logged once, from the step that decomposed
    them) and a row logged at a logging step are never handed to the loggers again at a later logging step
    (Lightning keeps a hook's logged values for the whole epoch); ``step_every`` 3 steps the optimizer every
    third batch, so most logging steps book no new step."""
    L = _lightning()
    import csv

    from conserve.integrations.lightning import ConserveCallback

    class Manual(type(_lit_module(L))):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.manual_backward(loss)
            if (batch_idx + 1) % step_every == 0:
                opt = self.optimizers()
                opt.step()
                opt.zero_grad()
            return loss

    cb = ConserveCallback(sinks=[])
    trainer = L.Trainer(default_root_dir=str(tmp_path), max_epochs=2, log_every_n_steps=1 if step_every > 1 else 2,
                        accelerator="cpu", devices=1, logger=L.loggers.CSVLogger(str(tmp_path), name="csv", version=0),
                        callbacks=[cb], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Manual())
    booked = cb.tracker.step_count
    assert booked == (10 if step_every == 1 else 2 * (5 // step_every))
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        table = [r for r in csv.DictReader(f) if r.get("conserve/step")]
    steps = [int(float(r["conserve/step"])) for r in table]
    assert steps and len(steps) == len(set(steps)), steps  # each row logged once
    drift = [int(float(r["conserve/drift_step"])) for r in table if r.get("conserve/drift_step")]
    assert drift and len(drift) == len(set(drift)), drift  # each decomposition logged once
    assert all(bool(r.get("conserve/drift_step")) == bool(r.get("conserve/drift/relu/second")) for r in table)
    assert "conserve/eps/relu" in trainer.callback_metrics  # still there for ModelCheckpoint / EarlyStopping


def test_lightning_gradient_accumulation_logs_drift_and_resumes(tmp_path):
    """``accumulate_grad_batches=2``: one row per optimizer step, and a row is logged at the batch that steps
    (Lightning logs nothing at an accumulating batch: the drift columns given there were lost); resumed from
    the step-3 checkpoint (an epoch boundary) the series continues with the same values."""
    L = _lightning()
    import csv

    from conserve.integrations.lightning import ConserveCallback

    class Acc(type(_lit_module(L))):
        def train_dataloader(self):  # 6 batches = 3 optimizer steps an epoch
            g = torch.Generator().manual_seed(0)
            ds = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g))
            return torch.utils.data.DataLoader(ds, batch_size=4)

    def fit(cb, ckpt_path=None):
        trainer = L.Trainer(default_root_dir=str(tmp_path), max_steps=6, log_every_n_steps=2, accelerator="cpu",
                            devices=1, accumulate_grad_batches=2,
                            logger=L.loggers.CSVLogger(str(tmp_path), name="csv", version=0),
                            callbacks=[cb, L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"),
                                                                       every_n_train_steps=3, save_top_k=-1)],
                            enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Acc(), ckpt_path=ckpt_path)
        with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
            table = [(int(float(r["conserve/step"])), r["conserve/drift_step"]) for r in csv.DictReader(f)
                     if r.get("conserve/step")]
        return trainer, table

    cb = ConserveCallback(drift_every=4)
    trainer, table = fit(cb)
    assert cb.tracker.step_count == trainer.global_step == 6
    assert table == [(2, "1.0"), (4, ""), (6, "5.0")]
    jsonl = Path(trainer.log_dir) / "conserve" / "metrics.jsonl"
    full = _rows(jsonl)
    assert [r["step"] for r in full] == list(range(1, 7))
    cb2 = ConserveCallback(drift_every=4)
    _, table2 = fit(cb2, ckpt_path=str(tmp_path / "ck" / "epoch=0-step=3.ckpt"))
    assert table2 == [(4, ""), (6, "5.0")] and cb2.tracker.step_count == 6
    again = _rows(jsonl)
    assert [r["step"] for r in again] == list(range(1, 7))
    for a, b in zip(full[3:], again[3:]):
        assert b["eps/relu"] == pytest.approx(a["eps/relu"], rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_lightning_gradient_clipping_by_value_breaks_the_laws(tmp_path, algorithm):
    """``gradient_clip_algorithm="value"`` clips each gradient entry on its own: a clipped SGD step is not
    along the gradient, the first-order drift term no longer vanishes, and the laws are marked
    ``broken_by``; clipping by norm (one factor for the whole gradient) keeps them.  Without a logger the
    callback logs for ``callback_metrics`` only (no Lightning warning per key)."""
    L = _lightning()
    from conserve.integrations.lightning import ConserveCallback
    from conserve.tracking.breakers import BrokenLawWarning

    class SGDModule(type(_lit_module(L))):  # float64: the identity's first-order term is exact to ~1e-16
        def __init__(self):
            super().__init__()
            self.double()

        def training_step(self, batch, batch_idx):
            return super().training_step([batch[0].double(), batch[1]], batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = ConserveCallback(sinks=[], drift_every=1, snapshot_budget=None, fp64=True)
    trainer = L.Trainer(default_root_dir=str(tmp_path), max_steps=4, log_every_n_steps=2, accelerator="cpu",
                        devices=1, logger=False, gradient_clip_val=1e-3, gradient_clip_algorithm=algorithm,
                        callbacks=[cb], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer.fit(SGDModule())
    assert not [x for x in w if "no logger configured" in str(x.message)]
    broken = [str(x.message) for x in w if issubclass(x.category, BrokenLawWarning)]
    t = cb.tracker.totals()["relu"]
    if algorithm == "value":
        assert set(cb.tracker.broken_by) == {l.name for l in cb.tracker.laws}
        assert len(broken) == 1 and "clip by 'norm'" in broken[0]
        assert t["first"] > 10 * t["second"], t  # really broken: the first-order term dominates
    else:
        assert cb.tracker.broken_by == {} and broken == []
        assert t["first"] < 1e-6 * t["second"], t  # plain SGD, one clipping factor: the Noether identity holds
    assert "conserve/eps/relu" in trainer.callback_metrics


def _two_optimizer_module(L, split_law=False):
    class TwoOpt(L.LightningModule):  # manual optimization, one optimizer per sub-network (a GAN's layout)
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
            self.aux = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y) + F.cross_entropy(self.aux(x), y)
            opts = self.optimizers()
            for o in opts:
                o.zero_grad()
            self.manual_backward(loss)
            for o in opts:
                o.step()
            return loss

        def configure_optimizers(self):
            if split_law:  # net's law read by both optimizers
                return [torch.optim.SGD([*self.net[0].parameters(), *self.aux.parameters()], lr=1e-2),
                        torch.optim.SGD(self.net[2].parameters(), lr=1e-2)]
            return [torch.optim.SGD(self.net.parameters(), lr=1e-2), torch.optim.AdamW(self.aux.parameters(), lr=1e-2)]

        def train_dataloader(self):  # 2 batches an epoch
            g = torch.Generator().manual_seed(0)
            ds = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
            return torch.utils.data.DataLoader(ds, batch_size=4)

    return TwoOpt()


def test_lightning_two_optimizers_one_tracker_each_and_resume(tmp_path):
    """Two optimizers (manual optimization): one tracker per optimizer over the laws it holds, logged under
    ``conserve/opt<i>/``, one JSONL file each, both in the checkpoint; the resumed series continue."""
    L = _lightning()
    import csv

    from conserve.integrations.lightning import ConserveCallback

    def fit(cb, max_steps, ckpt_path=None):  # (Lightning's global_step counts both optimizers' steps)
        trainer = L.Trainer(default_root_dir=str(tmp_path), max_steps=max_steps, log_every_n_steps=1,
                            accelerator="cpu", devices=1, logger=L.loggers.CSVLogger(str(tmp_path), name="csv",
                                                                                     version=0),
                            callbacks=[cb, L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"),
                                                                       every_n_train_steps=4, save_top_k=-1)],
                            enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_two_optimizer_module(L), ckpt_path=ckpt_path)
        return trainer

    cb = ConserveCallback()
    trainer = fit(cb, 8)
    assert [t.step_count for t in cb.trackers] == [4, 4]
    assert [{l.params[0].split(".")[0] for l in t.laws} for t in cb.trackers] == [{"net"}, {"aux"}]
    with pytest.raises(UsageError, match="use .trackers"):
        cb.tracker  # noqa: B018
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        table = [r for r in csv.DictReader(f) if r.get("conserve/opt0/step")]
    assert [int(float(r["conserve/opt0/step"])) for r in table] == [1, 2, 3, 4]
    assert all(r["conserve/opt1/eps/relu"] and r["conserve/opt1/step"] == r["conserve/opt0/step"] for r in table)
    files = [Path(trainer.log_dir) / "conserve" / f"opt{i}" / "metrics.jsonl" for i in (0, 1)]
    full = [_rows(f) for f in files]
    assert [[r["step"] for r in rows] for rows in full] == [[1, 2, 3, 4]] * 2
    cb2 = ConserveCallback()
    fit(cb2, 8, ckpt_path=str(tmp_path / "ck" / "epoch=0-step=4.ckpt"))  # 2 steps each: an epoch boundary
    assert [t.step_count for t in cb2.trackers] == [4, 4]
    for f, rows in zip(files, full):
        again = _rows(f)
        assert [r["step"] for r in again] == [1, 2, 3, 4]
        for a, b in zip(rows[2:], again[2:]):
            assert b["eps/relu"] == pytest.approx(a["eps/relu"], rel=1e-5, abs=1e-8)


def test_lightning_law_read_by_two_optimizers_is_not_tracked(tmp_path):
    L = _lightning()
    from conserve.integrations.lightning import ConserveCallback

    cb = ConserveCallback(sinks={})
    trainer = L.Trainer(default_root_dir=str(tmp_path), max_steps=2, accelerator="cpu", devices=1, logger=False,
                        callbacks=[cb], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer.fit(_two_optimizer_module(L, split_law=True))
    said = [str(x.message) for x in w if "several optimizers" in str(x.message)]
    assert len(said) == 1 and "net.0-2/unit (optimizers 0, 1)" in said[0], said
    assert len(cb.trackers) == 1 and {l.params[0].split(".")[0] for l in cb.trackers[0].laws} == {"aux"}
    assert cb.trackers[0].step_count == 1
    with pytest.raises(UsageError, match="sinks=.optimizer index"):
        ConserveCallback(sinks=[]).on_fit_start(trainer, trainer.lightning_module)


def test_lightning_module_holding_an_hf_model_resumes_into_a_new_logger_version(tmp_path):
    """The common pattern ``self.lm = AutoModelForCausalLM.from_config(...)`` inside a LightningModule: the
    HF laws are found under ``lm.``; a logger that opens a new version on resume gets the resumed rows (the
    series continues: same eps as the uninterrupted run) and a warning naming the new file."""
    L = _lightning()
    T = pytest.importorskip("transformers")
    from conserve.integrations.lightning import ConserveCallback

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lm = T.AutoModelForCausalLM.from_config(T.LlamaConfig(
                vocab_size=17, hidden_size=16, intermediate_size=12, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2))

        def training_step(self, batch, batch_idx):
            return self.lm(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):  # 2 batches an epoch: the step-2 checkpoint is at an epoch boundary
            return torch.utils.data.DataLoader(torch.randint(0, 17, (4, 6), generator=torch.Generator().manual_seed(0)),
                                               batch_size=2)

    def fit(cb, ckpt_path=None):
        trainer = L.Trainer(default_root_dir=str(tmp_path), max_steps=4, log_every_n_steps=2, accelerator="cpu",
                            devices=1, logger=L.loggers.CSVLogger(str(tmp_path), name="csv"), callbacks=[
                                cb, L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=2,
                                                                save_top_k=-1)],
                            enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            trainer.fit(LitLM(), ckpt_path=ckpt_path)
        return trainer, [str(x.message) for x in w if str(x.message).startswith("conserve: resumed")]

    cb = ConserveCallback()
    first, said = fit(cb)
    assert said == [] and {l.params[0].split(".")[0] for l in cb.tracker.laws} == {"lm"}
    full = _rows(Path(first.log_dir) / "conserve" / "metrics.jsonl")
    second, said = fit(ConserveCallback(), ckpt_path=str(tmp_path / "ck" / "epoch=0-step=2.ckpt"))
    new = Path(second.log_dir) / "conserve" / "metrics.jsonl"
    assert second.log_dir != first.log_dir and len(said) == 1 and str(new) in said[0] and "step 2" in said[0]
    resumed = _rows(new)
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        assert b["eps/vo"] == pytest.approx(a["eps/vo"], rel=1e-5)


def test_lightning_standalone_package_name(tmp_path):
    try:
        import pytorch_lightning as PL
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"pytorch_lightning unavailable: {e}")
    from conserve.integrations.lightning import ConserveCallback

    cb = ConserveCallback(sinks=[])
    trainer = PL.Trainer(default_root_dir=str(tmp_path), max_steps=4, log_every_n_steps=2, accelerator="cpu",
                         logger=PL.loggers.CSVLogger(str(tmp_path), name="csv", version=0), callbacks=[cb],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(_lit_module(PL))
    assert cb.tracker.step_count == 4
    text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "conserve/eps/relu" in text.splitlines()[0]


def test_logged_drift_columns_come_from_the_latest_decomposition():
    """With the default cadence the logging step is seldom a drift step: the framework still gets the
    drift columns of the latest step that decomposed them (once each, with ``drift_step``), never a row
    of NaN; the eps columns are the logging step's own."""
    from conserve.integrations._run import TrackedRun

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = TrackedRun(model, opt, every=3, drift_every=4)
    assert run.tracker.drift_every > 1
    x = torch.randn(16, 6)
    logs = []
    for step in range(1, 13):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step % 4 == 0:  # drift steps are 1, 5, 9
            logs.append(run.scalars())
    assert [d["conserve/step"] for d in logs] == [4.0, 8.0, 12.0]
    assert [d["conserve/drift_step"] for d in logs] == [1.0, 5.0, 9.0]
    for d in logs:
        assert math.isfinite(d["conserve/drift/relu/second"]) and math.isfinite(d["conserve/eps/relu"])
    assert run.scalars() == {}  # nothing new
    run.close()
    assert not any(type(s).__name__ == "_Seen" for s in run.tracker.sinks)


def test_hf_new_trainer_after_one_that_raised_keeps_one_clean_series(tmp_path):
    """A Trainer interrupted at step 7 (no callback hook closes its tracker), then a new Trainer and
    callback resumed from checkpoint-5 in the same process: the file holds the resumed series 1..10;
    the stale tracker's pending step-7 row was appended after it when collected, or cut the new rows."""
    import gc

    T = _hf()
    from conserve.integrations.hf import ConserveCallback

    class Interrupt(T.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 7:
                raise KeyboardInterrupt

    trainer = _hf_trainer(tmp_path, [ConserveCallback(), Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    jsonl = tmp_path / "conserve" / "metrics.jsonl"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _hf_trainer(tmp_path, [ConserveCallback()]).train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
        del trainer
        gc.collect()
    assert [r["step"] for r in _rows(jsonl)] == list(range(1, 11))
    assert any("still open in another JSONLSink" in str(x.message) for x in w)


def test_lightning_without_a_logger_writes_no_conserve_folder_into_the_root(tmp_path):
    """``logger=False``: the log dir is ``default_root_dir`` (often the working directory, where a folder named
    ``conserve`` would shadow an editable install of the package): the rows go to ``conserve_logs/``."""
    L = _lightning()
    from conserve.integrations.lightning import ConserveCallback

    cb = ConserveCallback()
    trainer = L.Trainer(default_root_dir=str(tmp_path), max_steps=2, log_every_n_steps=1, accelerator="cpu",
                        devices=1, logger=False, callbacks=[cb], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(_lit_module(L))
    assert not (tmp_path / "conserve").exists()
    assert len(_rows(tmp_path / "conserve_logs" / "metrics.jsonl")) == 2
