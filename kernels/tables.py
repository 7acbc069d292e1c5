"""Named columns of every work table of the Triton path: the one place that says what column ``j`` of
a row means, for the host builders (``launch.py``, ``step_runner.py``), the binder (``runner.py``) and
the kernels (``gram.py``, ``norms.py``, ``step.py``, which read e.g. ``tables.GRAM_TERM.X_OFF``: a
module attribute that Triton folds to a constant).  Every table is int64, row-major, ``COLS`` columns
(``FACTOR``, ``STEP_SCALAR``: fp32).

Offsets are in elements relative to the launch's base pointer of its dtype group; strides in elements.
"""
from __future__ import annotations

__all__ = ["GRAM_TERM", "GRAM_ITEM", "GRAM_GROUP", "FACTOR", "REGION", "NORM_ITEM", "FINISH_ROW", "FINISH_BLOCK",
           "STEP_TENSOR", "STEP_PROG", "STEP_SCALAR", "STEP_FINISH"]


class _Table:
    """Columns are the upper-case int attributes of a subclass; ``NAMES`` (lower case, in column order)
    and ``COLS`` are derived from them."""

    NAMES: tuple = ()
    COLS: int = 0

    def __init_subclass__(cls):
        cols = sorted((v, k) for k, v in vars(cls).items() if k.isupper() and isinstance(v, int) and k != "COLS")
        assert [v for v, _ in cols] == list(range(len(cols))), f"{cls.__name__}: columns must be 0..n-1"
        cls.NAMES = tuple(k.lower() for _, k in cols)
        cls.COLS = len(cols)

    @classmethod
    def row(cls, **values) -> tuple:
        """One row in column order from named values (every column must be given)."""
        if set(values) != set(cls.NAMES):
            raise KeyError(f"{cls.__name__}.row: got {sorted(values)}, columns are {cls.NAMES}")
        return tuple(values[n] for n in cls.NAMES)


class GRAM_TERM(_Table):
    """Gram terms (``gram.gram_kernel``), sorted by output slot then layout.  layout 0: x_cs == 1 (row
    blocks), 1: x_rs == 1 (column blocks), 2: general strides; y_*: the second tensor (bilinear, DRIFT new)."""
    X_OFF, X_RS, X_CS, N, LAYOUT, Y_OFF, Y_RS, Y_CS = range(8)


class GRAM_ITEM(_Table):
    """Gram items (one program each): the slot's terms [t0, t1) (layout 0 in [t0, ta), 1 in [ta, tb), 2 in
    [tb, t1)), the contracted chunk [k0, k1), the upper-triangular output tile (ti, tj)."""
    T0, T1, K0, K1, TI, TJ, TA, TB = range(8)


class GRAM_GROUP(_Table):
    """Gram finishing groups (``gram.gram_finish``): item ids ``order[i0:i1]`` of output tile (slot, ti, tj)."""
    I0, I1, SLOT, TI, TJ = range(5)


class FACTOR(_Table):
    """DRIFT factors per term (fp32): ``a_t`` and ``sign_t * (a_t^2 - 1)``."""
    A, SDEC = range(2)


class REGION(_Table):
    """Norm regions (``norms.rowcol_kernel``): an S x F block (F the contiguous axis if layout 0); func 0:
    ``(x + shift)^2``, 1: ``x`` (SumTerm); fast_base: element index of its row sums (-1: none); y_*: bilinear."""
    X_OFF, SS, FS, S, F, LAYOUT, FUNC, FAST_BASE, UNUSED, Y_OFF, YSS, YFS = range(12)


class NORM_ITEM(_Table):
    """Norm items (one program each): rows [s_start, s_end) of the column tile at f0; partial offsets (-1:
    unused): row s's fast partial at ``part[fast_off + s]``, column f's slow one at ``part[slow_off + f]``."""
    REGION, S_START, S_END, F0, FAST_OFF, SLOW_OFF = range(6)


class FINISH_ROW(_Table):
    """Finishing rows (``norms.finish_rows``): ``elem[elem_base + j] = sum_i part[part_off + i*length + j]``."""
    PART_OFF, NROWS, LENGTH, ELEM_BASE = range(4)


class FINISH_BLOCK(_Table):
    """Finishing blocks: one program per (finishing row, first of its ``FIN_BC`` columns)."""
    ROW, C0 = range(2)


class STEP_TENSOR(_Table):
    """Tensors of a fused optimizer step (``step.step_kernel``; 16 columns, 3 spare): element
    offsets of param, grad, first and second state buffer (0 when absent); matrix view ``R x C`` of
    ``B`` batches (``br = B*R``), row blocks ``nrb``; partial-buffer offsets of the row / column
    quadratic and linear statistics (-1: not requested); ``fresh``: SGD momentum not yet initialised."""
    P_OFF, G_OFF, M_OFF, V_OFF, R, C, BR, NRB, ROW_Q, ROW_L, COL_Q, COL_L, FRESH, SPARE0, SPARE1, SPARE2 = range(16)


class STEP_PROG(_Table):
    """Programs of the step kernel: tensor, batch, row block, column block."""
    TENSOR, BATCH, ROW_BLOCK, COL_BLOCK = range(4)


class STEP_SCALAR(_Table):
    """Per-tensor fp32 scalars of the step (Adam: step size and bias-correction factor)."""
    STEP_SIZE, BC2S = range(2)


class STEP_FINISH(_Table):
    """Finishing rows of the step statistics: ``stats[q, out + f] = sum_i part[q, off + i*F + f]``, i < nrows."""
    OFF, NROWS, F, OUT = range(4)
