"""Float rounding floors: the size below which a computed quantity cannot be told from rounding.

A law value ``h = sum_i s_i x_i`` (a quadratic law: ``x_i`` products of weights, ``s_i`` = +-1; a linear
law: ``x_i`` weights) computed in a dtype with unit roundoff ``u`` carries an error of about
``u * sqrt(n) * sum_i |x_i|`` (the probabilistic bound of Higham and Mary 2019 for recursive or blocked
summation of ``n`` terms; the worst case is ``n u sum |x_i|``). ``sum_i |x_i|`` is the law's
*magnitude*: the same sum with every sign + (the tracker's eps guard and the control use it). A drift
term formed from ``values`` such rounded numbers (2 for ``h(k+1) - h(k)``) has a floor ``sqrt(values)``
times larger (independent errors add in quadrature).

``rounding_floor`` is that number; ``unit_roundoff`` reads a dtype. They are shared by the run report
(``conserve.report``: a drift term at or under the floor is "undetermined at this precision") and by any
check that compares a computed quantity with zero (a first-order term, a gradient's product with a law's
gradient).  ``relative_floor`` is the floor of a quantity already divided by its scale (a ratio such as the
gradient check's ``|<grad h, g>| / (||grad h|| ||g||)``): a multiple of the unit roundoff of the dtype
the inputs were computed in, never under a multiple of float32's (model code sums in float32 inside
half-precision and float64 models alike).
"""
from __future__ import annotations

import math

#: unit roundoff u = 2**-p (half the machine epsilon) of the floating formats conserve accumulates in
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "tfloat32": 2.0 ** -11, "float16": 2.0 ** -11,
                 "bfloat16": 2.0 ** -8}


def unit_roundoff(dtype="float32") -> float:
    """The unit roundoff of ``dtype``: a name (``"float32"``, ``"fp32"``, ``"bf16"``...), a ``torch.dtype`` or
    numpy dtype, or a float taken as the roundoff itself (e.g. a measured accumulation error)."""
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool):
        if not (dtype > 0 and math.isfinite(dtype)):
            raise ValueError(f"a unit roundoff must be a positive finite number, got {dtype!r}")
        return float(dtype)
    name = str(dtype).rsplit(".", 1)[-1].lower()  # torch.float32 -> float32 (numpy dtypes print as float32)
    name = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32", "tf32": "tfloat32",
            "fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(name, name)
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff known for dtype {dtype!r}; pass one of {sorted(UNIT_ROUNDOFF)} or a float")
    return UNIT_ROUNDOFF[name]


def rounding_floor(magnitude: float, n_summed: int = 1, dtype="float32", values: int = 2) -> float:
    """The float rounding floor of a drift term: ``u * magnitude * sqrt(n_summed * values)``.

    ``magnitude``: the size of the summands behind the term (a law's value with every sign +, or a norm
    of such values over a family's laws); ``n_summed``: the elements summed into each value (1 when
    unknown: then the floor is a lower estimate); ``dtype``: the accumulation dtype or its unit roundoff
    (``unit_roundoff``); ``values``: how many rounded values the term combines (2 for ``h(k+1) - h(k)``,
    1 for a single law value). A computed term at or under this floor is consistent with zero."""
    if not (magnitude >= 0 and math.isfinite(magnitude)):
        raise ValueError(f"magnitude must be finite and >= 0, got {magnitude!r}")
    return unit_roundoff(dtype) * magnitude * math.sqrt(max(int(n_summed), 1) * max(int(values), 1))


def relative_floor(dtype="float32", factor: float = 1.0, float32_factor: float = 0.0) -> float:
    """``max(factor * u, float32_factor * u_32)``: the rounding floor of a relative quantity (a ratio to its
    own scale) computed from values rounded in ``dtype`` (unit roundoff ``u``, ``unit_roundoff``), where
    float32 arithmetic inside the computation sets a minimum (``u_32``: float32's unit roundoff).  The
    factors are the measured or derived number of roundoffs the quantity carries (the gradient check:
    ``conserve.analysis.gradcheck.FLOOR_FACTORS``)."""
    if not (factor >= 0 and float32_factor >= 0 and math.isfinite(factor) and math.isfinite(float32_factor)):
        raise ValueError(f"factors must be finite and >= 0, got {factor!r}, {float32_factor!r}")
    return max(factor * unit_roundoff(dtype), float32_factor * UNIT_ROUNDOFF["float32"])
