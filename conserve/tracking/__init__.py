"""conserve.tracking: what turns each optimizer step into a metric row.

One step, from ``optimizer.step()`` to a written row (``conserve.tracker.Tracker`` orchestrates):

* ``drift``: before the step, ``Sampler.snapshot`` copies what the decomposed laws read of ``theta_k``;
  after it, one DRIFT pass (``drift_pieces``) and ``Assembly.terms`` give the identity's ``decay``,
  ``first`` and ``second`` terms;
* ``book``: ``Book.row`` turns ``h(theta_{k+1})``, ``h_k``, ``h_0`` and those terms into the row (``eps``
  per family and group, the norms of the five ``TERMS``, the cumulative sums); ``Layout`` indexes the
  law entries;
* ``values``: ``Values`` (law values in the plan layout) and ``TERMS``, the data the others pass;
* ``sinks``: JSONL / TensorBoard / W&B writers the rows are flushed to; ``lock``: one writer per run dir;
* ``breakers``: which laws the optimizer's groups, a freeze or the caller break (``broken_by``);
* ``distributed`` / ``shard_plan``: a rank's share of each step and the one packed all-reduce before
  ``Book`` finishes the row; ``control``: a control-law monitor.

The fused optimizers (``conserve.optim.fused``) compute the terms inside their step and book through
``Tracker.assemble`` and ``Tracker.record_step``, the same path.
"""
