"""Fused optimizer steps: update every weight (AdamW / Adam / SGD) and measure it in the same pass.

Knows nothing of nn.Module or of laws: it takes lists of tensors, the hyper-parameters of one
parameter group, and per tensor a *stats request* (which row/column statistics of the updated
weight to accumulate).  The optimizer (``conserve/optim/fused.py``) maps those statistics onto the
law plan's ``NormTerm``/``SumTerm`` entries.

Matrix form.  Every tensor is read as ``B x R x C`` (``B`` = product of the leading dims, ``(R, C)`` =
the last two; a vector of n entries is ``1 x 1 x n``, a scalar ``1 x 1 x 1``), contiguous.  With
``old`` the weight before the step, ``new`` after it, ``a`` the decoupled decay factor of the group
(``1 - lr*wd`` for AdamW and for plain SGD, else 1) and ``Delta = new - a*old`` (spec "Discrete steps:
the exact drift identity"), a stats slot of kind

* ``Q`` (quadratic, for NormTerms) accumulates ``[new^2, a*old*Delta, Delta^2, (a^2-1)*old^2]``,
* ``L`` (linear, for SumTerms) accumulates     ``[new,   Delta,       0,       (a-1)*old]``,

summed over the columns of each row (axis ``row``: ``B*R`` slots) or over the rows of each column
within one batch entry (axis ``col``: ``B*C`` slots).  A NormTerm over whole rows then gets
``h = sum sign*q0``, ``first = 2*sum sign*q1``, ``second = sum sign*q2``, ``decay = sum sign*q3``: the
statistics hold ``q1`` as it is, and the factor 2 is applied where they are added into the entries
(``step_fold``).

This module is the public face of the step; each part lives in its own module:

* ``step_twin``: ``Hyper``, ``StatsRequest``, ``matrix_shape`` and the torch twin (``step_reference``:
  the update op by op as ``torch.optim`` does it; ``stats_reference``: the statistics with torch
  reductions; ``step_stats_reference``: both on blocks of whole rows);
* ``step_runner``: ``step_triton``, the Triton path's host side (checks, launch layouts, launch);
* ``step``: its ``@triton.jit`` kernels (``step_kernel``, ``finish_kernel``);
* ``step_fold``: the finish, the line statistics added into the plan's entries (``fold``,
  ``finish_reference``, ``finish_compact``).
"""
from __future__ import annotations

from .step_fold import Fold, compact_terms, finish_compact, finish_reference, fold
from .step_runner import layout_key, step_triton, triton_eligible
from .step_twin import (CHUNK_MAX, CHUNK_MIN, NQ, Hyper, StatsRequest, chunk_bound, matrix_shape, stats_reference,
                        step_reference, step_stats_reference)

__all__ = ["Hyper", "StatsRequest", "matrix_shape", "step_reference", "step_triton", "stats_reference",
           "step_stats_reference", "chunk_bound", "finish_reference", "compact_terms", "finish_compact",
           "Fold", "fold", "NQ", "CHUNK_MAX", "CHUNK_MIN", "triton_eligible", "layout_key"]
