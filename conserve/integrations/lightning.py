"""``ConserveCallback`` for Lightning (``lightning`` or ``pytorch_lightning``): one callback, conserve's
metrics in the Trainer's loggers.

    trainer = lightning.Trainer(callbacks=[ConserveCallback()], ...)

At ``on_fit_start`` it detects the LightningModule's laws and tracks the Trainer's optimizer through its
step hooks (``LightningOptimizer`` is looked through; steps a GradScaler skips are not booked).
After each batch that stepped, the step's ``loss`` (from ``training_step``'s output) is attached to
the row; at Lightning's logging steps (``log_every_n_steps``) the latest row is logged with
``pl_module.log_dict`` under ``conserve/<key>`` (family keys ``eps/<family>``,
``drift/<family>/<term>``, ``conserve/step`` = the tracker's step), so every logger (CSV,
TensorBoard, W&B...) gets it and ``ModelCheckpoint``/``EarlyStopping`` can monitor it. Every row
also goes to the callback's sinks: by default ``<trainer.log_dir>/conserve/metrics.jsonl``
(global rank 0). The tracker state is the callback's ``state_dict`` in Lightning checkpoints, so
``fit(ckpt_path=...)`` continues the series (the JSONL file drops the rows after the checkpoint; a
logger that opens a new version on resume, as Lightning's default does, puts the resumed rows in the
new version's file, from the checkpoint's step on, with a warning naming it).
``on_train_end`` (and ``on_exception``) flush and close the sinks. ``gradient_clip_algorithm="value"``
marks every law ``broken_by`` (each gradient entry is clipped on its own; clipping by norm keeps the
laws). Without a logger (``logger=False``) the row still reaches ``trainer.callback_metrics``.
Several optimizers (manual optimization): one tracker per optimizer, logged under ``conserve/opt<i>/``
(``ConserveCallback`` docstring).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

try:
    from lightning.pytorch import Callback
except ImportError as first:  # the standalone package
    try:
        from pytorch_lightning import Callback
    except ImportError:
        import importlib.util

        if importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning"):
            raise ImportError(f"conserve.integrations.lightning: Lightning is installed but does not import ({first}); "
                              "fix that environment (e.g. a torchvision that does not match torch)") from first
        raise ImportError("conserve.integrations.lightning needs Lightning: pip install 'torch-conserve[lightning]'") \
            from None

from ..errors import UsageError
from ..tracking.breakers import mark_broken
from ..tracking.sinks import JSONLSink
from ._run import TrackedRun, grad_dtype_of

__all__ = ["ConserveCallback"]


class ConserveCallback(Callback):
    """Track the conservation laws of a ``LightningModule`` (see the module docstring).

    Args:
        every: tracker flush period in steps (default ``trainer.log_every_n_steps``; the callback also
            flushes at every logging step).
        sinks: where every row goes (default ``None``: ``<log_dir>/conserve/metrics.jsonl`` on global
            rank 0, ``<default_root_dir>/conserve_logs/metrics.jsonl`` with ``logger=False``; ``[]`` for the
            loggers only). With several optimizers: a dict ``{optimizer index:
            [sinks]}`` (default ``<log_dir>/conserve/opt<i>/metrics.jsonl``; a sink writes one series).
        laws: explicit laws instead of ``model.conservation_laws()`` / ``conserve.detect(model)``.
        layers: also log the per-layer ``eps/<family>/layer<i>`` keys.
        prefix: key prefix in the logs (default ``"conserve/"``; with several optimizers
            ``"conserve/opt<i>/"`` per optimizer).
        record_loss: attach ``training_step``'s loss to each stepped row (default True).
        **tracker_kwargs: ``drift``, ``fp64``, ``backend``, ``monitors``, ``on_nonfinite``, ``check_gradients``
            (its ``grad_dtype`` follows the trainer's ``precision``, e.g. ``"bf16-mixed"``, unless given).

    Several optimizers (``configure_optimizers`` returning a list, manual optimization: a GAN, a
    separate optimizer per sub-network): one tracker per optimizer, over the laws whose parameters it
    holds; a law that reads the parameters of two optimizers is not tracked (each step moves one side
    only; one warning names them), nor one no optimizer holds. ``self.trackers`` lists the trackers (optimizer
    order); ``self.tracker`` is the tracker of a single optimizer. Raises ``UsageError`` at
    ``on_fit_start`` when no optimizer holds a law, or for a ``sinks`` list with several optimizers.
    """

    def __init__(self, *, every: int | None = None, sinks=None, laws=None, layers: bool = False,
                 prefix: str = "conserve/", record_loss: bool = True, **tracker_kwargs):
        self.every, self.sinks, self.laws, self.layers, self.prefix = every, sinks, laws, layers, prefix
        self.record_loss, self.tracker_kwargs = record_loss, tracker_kwargs
        self.runs: list[TrackedRun] = []
        self._indices: list[int] = []  # the optimizer index of each run
        self._pending_state: dict | None = None
        self._seen: list[int] = []
        self._logged_keys: set[str] = set()  # keys given to ``log_dict`` whose values Lightning still holds

    @property
    def run(self) -> TrackedRun | None:
        return self.runs[0] if len(self.runs) == 1 else None

    @property
    def trackers(self) -> list:
        return [r.tracker for r in self.runs]

    @property
    def tracker(self):
        if len(self.runs) > 1:
            raise UsageError(f"ConserveCallback tracks {len(self.runs)} optimizers: use .trackers (one per optimizer)")
        return None if not self.runs else self.runs[0].tracker

    def _close(self) -> None:
        for r in self.runs:
            r.close()

    def _split_laws(self, pl_module, opts) -> list[tuple[int, object]]:
        """``[(optimizer index, laws)]``: each law goes to the one optimizer that holds its parameters (a law
        no optimizer moves is left out)."""
        from ..tracker import model_laws
        from ..wrappers import unwrap as _unwrap
        from ..tracking.breakers import unwrap_optimizer

        if self.laws is None:
            laws, _ = model_laws(_unwrap(pl_module))
        else:
            laws = self.laws.laws if hasattr(self.laws, "laws") and hasattr(self.laws, "declined") else self.laws
        named = dict(_unwrap(pl_module).named_parameters())
        held = [{id(p) for g in unwrap_optimizer(o).param_groups for p in g["params"]} for o in opts]
        per, split = {}, []
        for law in laws:
            ids = [id(named[p]) for p in law.params if p in named]
            owners = [i for i, h in enumerate(held) if any(x in h for x in ids)]
            if len(owners) == 1:  # (with parameters no optimizer holds: tracked there, marked broken_by)
                per.setdefault(owners[0], []).append(law)
            elif len(owners) > 1:
                split.append(f"{law.name} (optimizers {', '.join(map(str, owners))})")
        if split:
            warnings.warn(f"conserve: {len(split)} law(s) read the parameters of several optimizers and are not "
                          f"tracked (each optimizer's step moves one side only): {', '.join(split[:3])}"
                          f"{' ...' if len(split) > 3 else ''}; give each law's parameters to one optimizer",
                          RuntimeWarning, stacklevel=3)
        if not per:
            raise UsageError(f"ConserveCallback: none of the {len(opts)} optimizers holds all the parameters of a law; "
                             "give each law's parameters to one optimizer")
        return sorted(per.items())

    def on_fit_start(self, trainer, pl_module) -> None:
        self._close()
        opts = trainer.optimizers
        if not opts:
            raise UsageError("ConserveCallback needs an optimizer: configure_optimizers returned none")
        many = len(opts) > 1
        if many and self.sinks is not None and not isinstance(self.sinks, dict):
            raise UsageError(f"ConserveCallback: this module has {len(opts)} optimizers, each tracked on its own: pass "
                             "sinks={optimizer index: [sinks]} (a sink writes one series)")
        parts = self._split_laws(pl_module, opts) if many else [(0, self.laws)]
        # without a logger the log dir is default_root_dir, often the working directory, where a folder named
        # "conserve" would shadow the package for the next script run there (an editable install)
        root = Path(trainer.log_dir or trainer.default_root_dir) / "conserve" if trainer.logger is not None \
            else Path(trainer.default_root_dir) / "conserve_logs"
        every = self.every or max(1, int(trainer.log_every_n_steps or 50))
        self.runs, self._indices, fresh = [], [], []
        for i, laws in parts:
            sinks = self.sinks.get(i, []) if isinstance(self.sinks, dict) else self.sinks
            path = None
            if sinks is None:
                path = (root / f"opt{i}" if many else root) / "metrics.jsonl"
                sinks = [JSONLSink(path)] if trainer.is_global_zero else []
            fresh.append(path if path is not None and not (path.is_file() and path.stat().st_size > 0) else None)
            self.runs.append(TrackedRun(pl_module, opts[i], prefix=f"{self.prefix}opt{i}/" if many else self.prefix,
                                        layers=self.layers, laws=laws, every=every, sinks=list(sinks),
                                        **grad_dtype_of(getattr(trainer, "precision", None), self.tracker_kwargs)))
            self._indices.append(i)
        self._seen = [self._booked(r) for r in self.runs]
        clip = getattr(trainer, "gradient_clip_val", None)
        algo = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower()
        if clip and algo.endswith("value"):
            for r in self.runs:
                mark_broken(r.tracker, f"Lightning's gradient clipping by value (gradient_clip_val={clip}, "
                            "gradient_clip_algorithm='value': each gradient entry clipped on its own, so a clipped "
                            "step is not along the gradient); clip by 'norm' to keep the laws")
        if self._pending_state is not None:  # restored before the optimizers existed
            self._load(self._pending_state)
            self._pending_state = None
            for r, new in zip(self.runs, fresh):
                step = r.tracker.step_count
                if new is not None and step > 0 and trainer.is_global_zero:
                    warnings.warn(f"conserve: resumed at step {step} into a new metrics file {new} (the logger opened "
                                  f"a new version): steps 1-{step} are in the earlier run's file; give the logger a "
                                  "fixed version (e.g. CSVLogger(..., version=0)) or sinks=[JSONLSink(path)] to keep "
                                  "one file", RuntimeWarning, stacklevel=2)

    @staticmethod
    def _booked(run: TrackedRun) -> int:
        h = run._handle
        return h.steps if h is not None else run.tracker.step_count

    @staticmethod
    def _accumulating(trainer, pl_module, stepped: bool) -> bool:
        """True at a batch that only accumulates gradients (``accumulate_grad_batches``) under automatic
        optimization: Lightning hands the loggers nothing at it (``update_train_step_metrics``), so what
        this callback logged there would be dropped with the values of the next batch."""
        if not getattr(pl_module, "automatic_optimization", True):
            return False
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if hasattr(loop, "_should_accumulate"):
            return bool(loop._should_accumulate())
        return not stepped

    def _forget_logged(self, trainer) -> None:
        """Take the values this callback logged at an earlier batch out of Lightning's results: Lightning
        keeps every ``log`` value of a hook for the rest of the epoch and hands it to the loggers again at
        each logging step where the key is not logged anew, so a row's drift columns (logged once: they come
        from the step that decomposed them) and a whole row where no step was booked since the last logging
        step (manual optimization stepping less often than ``log_every_n_steps``) would be logged again, under
        a later step.  The values already logged stay in ``trainer.callback_metrics``."""
        results = getattr(trainer, "_results", None)
        if not self._logged_keys or results is None or not hasattr(results, "values"):
            return
        for item in list(results.values()):
            meta = getattr(item, "meta", None)
            if getattr(meta, "name", None) in self._logged_keys and hasattr(item, "reset"):
                item.reset()
        self._logged_keys.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.runs:
            return
        self._forget_logged(trainer)
        booked = [self._booked(r) for r in self.runs]
        stepped = [b != s for b, s in zip(booked, self._seen)]
        self._seen = booked
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.record_loss and torch.is_tensor(loss) and loss.numel() == 1:
            for r, did in zip(self.runs, stepped):
                if did:
                    r.record(loss=loss.detach())
        conn = getattr(trainer, "_logger_connector", None)
        due = conn.should_update_logs if hasattr(conn, "should_update_logs") else \
            trainer.global_step % max(1, trainer.log_every_n_steps) == 0
        if due and self._accumulating(trainer, pl_module, any(stepped)):
            due = False  # Lightning logs nothing at this batch: the row waits for the batch that steps
        if due:
            scalars = {}
            for r in self.runs:
                scalars.update(r.scalars())
            if scalars:
                pl_module.log_dict(scalars, on_step=True, on_epoch=False, prog_bar=False, batch_size=1,
                                   logger=bool(getattr(trainer, "loggers", True)))  # (no logger: callback_metrics only)
                self._logged_keys.update(scalars)

    def state_dict(self) -> dict:
        if len(self.runs) == 1:
            return {"tracker": self.runs[0].state_dict()}
        if self.runs:
            return {"trackers": {i: r.state_dict() for i, r in zip(self._indices, self.runs)}}
        return dict(self._pending_state) if self._pending_state is not None else {}

    def _load(self, state: dict) -> None:
        try:
            self._load_runs(state)
        except ValueError as e:  # Tracker.check_state, raised before that tracker changed
            raise UsageError(f"ConserveCallback: the checkpoint's tracker state cannot be loaded: {e}"
                             .replace("drop its 'conserve' entry to load the optimizer state alone",
                                      "fit without ckpt_path")) from None

    def _load_runs(self, state: dict) -> None:
        if "trackers" in state:
            if len(self.runs) < 2 or set(state["trackers"]) != set(self._indices):
                raise UsageError(f"ConserveCallback: the checkpoint holds trackers of optimizers "
                                 f"{sorted(state['trackers'])}, this run tracks {self._indices}: resume with the same "
                                 "optimizers")
            for i, r in zip(self._indices, self.runs):
                r.load_state_dict(state["trackers"][i])
        else:
            if len(self.runs) != 1:
                raise UsageError(f"ConserveCallback: the checkpoint holds one optimizer's tracker, this run tracks "
                                 f"{len(self.runs)}: resume with the same optimizers")
            self.runs[0].load_state_dict(state["tracker"])

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("tracker") is None and state_dict.get("trackers") is None:
            return
        if self.runs:
            self._load(state_dict)
        else:
            self._pending_state = state_dict

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()  # keep every row recorded before the failure
