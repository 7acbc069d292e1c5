"""The law families of ``../shared/spec/laws.md`` ("The catalogue"), one class each.

Conventions (spec "Conventions"): ``nn.Linear`` weights are ``(out_features, in_features)``; head ``i``
owns rows ``[i*D, (i+1)*D)`` of ``q_proj`` (and of ``k_proj``/``v_proj`` for kv head ``i``) and columns
``[i*D, (i+1)*D)`` of ``o_proj``. Every class has a ``build`` constructor taking ``Ref``s (see
``base.rows``, ``base.cols``, ``base.vector``) so the same family serves separate, fused, transposed
(GPT-2 Conv1D) and 3-D expert storage.
"""
from __future__ import annotations

from typing import Sequence

from .base import Law, Ref, Term, rows, vector

SEED = "Tran et al. 2026, Conservation Laws for Modern Neural Architectures"


def _norms(refs: Sequence[Ref | None], sign: float, **kw) -> list[Term]:
    return [Term("norm", r, sign, **kw) for r in refs if r is not None]


def _grams(refs: Sequence[Ref | None], sign: float) -> list[Term]:
    return [Term("gram", r, sign) for r in refs if r is not None]


class UnitBalance(Law):
    """Per hidden unit ``u``: ``||W_in[u,:]||^2 + b_in[u]^2 - ||W_out[:,u]||^2`` (vector of I).

    Shapes: ``W_in`` (I, H) read by rows, ``W_out`` (H, I) read by columns. Symmetry: scale unit u of
    ``W_in`` (and ``b_in``) by c, of ``W_out`` by 1/c.
    """

    @classmethod
    def build(cls, name: str, layer: int | None, *, up: Ref, down: Ref, up_bias: Ref | None = None, note: str = ""):
        if up.rows != down.rows or (up_bias is not None and up_bias.rows != up.rows):
            raise ValueError(f"{name}: up has {up.rows} units but down has {down.rows}")
        terms = _norms([up, up_bias], +1.0) + _norms([down], -1.0)
        return cls(name, layer, terms, up.rows, note)


class SwiGLUUnit(UnitBalance):
    """SwiGLU ``down(silu(gate x) * up x)``: ``||W_up[u,:]||^2 + b_up[u]^2 - ||W_down[:,u]||^2``; the gate
    is not involved (spec catalogue, SwiGLU row; seed paper). Also each MoE expert's units."""

    family = "swiglu"
    source = SEED


class ReLUUnit(UnitBalance):
    """ReLU / leaky-ReLU FFN unit ``u``: ``||W_in[u,:]||^2 + b_in[u]^2 - ||W_out[:,u]||^2`` (positive
    rescaling; Du et al. 2018, Marcotte et al. 2023)."""

    family = "relu"
    source = "Du et al. 2018; Marcotte, Gribonval, Peyre 2023"


class ReLUPowerUnit(UnitBalance):
    """FFN unit ``u`` whose activation is positively homogeneous of degree ``k`` (``f(c z) = c^k f(z)`` for
    ``c > 0``; squared ReLU ``relu(z)^2``: k = 2, So et al. 2021, used by Nemotron and Persimmon):
    ``||W_in[u,:]||^2 + b_in[u]^2 - k ||W_out[:,u]||^2`` (vector of I). Symmetry: unit u of ``W_in`` (and
    ``b_in``) scaled by c, of ``W_out`` by ``c^-k`` (docs/laws.md, "Homogeneous activations of degree k")."""

    family = "relu_power"
    source = "docs/laws.md (positive rescaling of a degree-k homogeneous activation)"

    @classmethod
    def build(cls, name: str, layer: int | None, *, up: Ref, down: Ref, up_bias: Ref | None = None, degree: float = 2.0,
              note: str = ""):
        if not degree > 0:
            raise ValueError(f"{name}: the degree of homogeneity must be positive, got {degree}")
        if up.rows != down.rows or (up_bias is not None and up_bias.rows != up.rows):
            raise ValueError(f"{name}: up has {up.rows} units but down has {down.rows}")
        terms = _norms([up, up_bias], +1.0) + _norms([down], -float(degree))
        return cls(name, layer, terms, up.rows, note)


class HeadGram(Law):
    """``sum_a X_a X_a^T - sum_b Y_b Y_b^T`` (D x D symmetric): X, Y are D-row blocks (biases as D x 1)."""

    kind = "gram"
    per = "law"

    @classmethod
    def build(cls, name: str, layer: int | None, *, plus: Sequence[Ref | None], minus: Sequence[Ref | None],
              note: str = ""):
        d = {r.rows for r in list(plus) + list(minus) if r is not None}
        if len(d) != 1:
            raise ValueError(f"{name}: blocks have different sizes {sorted(d)}; a Gram law needs one D")
        return cls(name, layer, _grams(plus, +1.0) + _grams(minus, -1.0), d.pop(), note)


class QKGram(HeadGram):
    """Query/key, kv group j: ``sum_{i in S_j} (Q_i Q_i^T + b_q,i b_q,i^T) - K_j K_j^T - b_k,j b_k,j^T``.

    Q_i = ``q_proj.weight[i*D:(i+1)*D, :]``. Symmetry GL(D): Q_i -> A Q_i, K_j -> A^-T K_j (spec: MHA
    and GQA/MQA rows). The key bias enters with its own sign (it is also conserved on its own: it gets
    zero gradient without RoPE). Not valid under RoPE (see ``RopePairs``) or per-head QK-norm."""

    family = "qk"
    source = SEED + " (MHA); GQA derived"


class VOGram(HeadGram):
    """Value/output, kv group j: ``V_j V_j^T + b_v,j b_v,j^T - sum_{i in S_j} O_i^T O_i`` with
    O_i = ``o_proj.weight[:, i*D:(i+1)*D]`` (spec: MHA value/output row). Holds with RoPE and QK-norm."""

    family = "vo"
    source = SEED + " (MHA); GQA derived"


class RopePassGram(HeadGram):
    """Partial rotary (rotary_dim R < D): the QK Gram law restricted to the pass-through dims
    ``[R, D)`` of each head (spec: partial rotary row, block-diagonal commutant)."""

    family = "rope_pass"
    source = "derived (spec: partial rotary)"


class DeepLinearGram(HeadGram):
    """Deep linear net between layers l, l+1: ``W_l W_l^T + b_l b_l^T - W_{l+1}^T W_{l+1}`` (n_l x n_l;
    Marcotte et al. 2023). Also between any two linear maps with nothing but identity between them."""

    family = "deep_linear"
    source = "Marcotte, Gribonval, Peyre 2023"


class RopePairs(Law):
    """RoPE, kv group j, rotary pair p (vector of R/2):
    ``sum_{t in p} ( sum_{i in S_j} (||W_q[q_i + t,:]||^2 + b_q^2) - ||W_k[k_j + t,:]||^2 - b_k^2 )``.

    Pairs: ``layout="half"`` (HF rotate_half, NeoX) ``{p, p + R/2}``; ``layout="interleaved"`` (GPT-J,
    Meta checkpoints) ``{2p, 2p+1}``, for p < R/2. Only scaled rotations commute with RoPE; the scaling
    gives this law (spec: RoPE rows). ``q_starts``/``k_starts`` are the first rows of each head in
    their weights (so fused qkv layouts work)."""

    family = "rope_pair"
    source = SEED + " (RoPE)"

    @classmethod
    def build(cls, name: str, layer: int | None, *, q_weight: str, q_shape, q_starts: Sequence[int],
              k_weight: str, k_shape, k_starts: Sequence[int], rotary_dim: int, layout: str,
              q_bias: str | None = None, k_bias: str | None = None, lead: tuple[int, ...] = (), note: str = ""):
        if rotary_dim % 2:
            raise ValueError(f"{name}: rotary_dim={rotary_dim} must be even")
        if layout not in ("half", "interleaved"):
            raise ValueError(f"{name}: RoPE layout must be 'half' or 'interleaved', got {layout!r}")
        half = rotary_dim // 2
        # (first row offset, step) of the two members of every pair
        members = [(0, 1), (half, 1)] if layout == "half" else [(0, 2), (1, 2)]
        terms: list[Term] = []
        for weight, shape, starts, bias, sign in ((q_weight, q_shape, q_starts, q_bias, +1.0),
                                                  (k_weight, k_shape, k_starts, k_bias, -1.0)):
            for s in starts:
                for off, step in members:
                    terms.append(Term("norm", rows(weight, shape, s + off, half, step=step, lead=lead), sign))
                    if bias is not None:
                        terms.append(Term("norm", vector(bias, s + off, half, step=step, lead=lead), sign))
        return cls(name, layer, terms, half, note)


class LinearSum(Law):
    """``sum_r W[r, :]`` (+ ``sum_r b[r]`` as the last entry): a linear law, one vector instance."""

    linear = True
    per = "law"

    @classmethod
    def build(cls, name: str, layer: int | None, *, weight: Ref, bias: Ref | None = None, note: str = ""):
        terms = [Term("sum", weight, +1.0)]
        if bias is not None:
            terms.append(Term("sum", bias, +1.0, offset=weight.cols))
        return cls(name, layer, terms, weight.cols + (1 if bias is not None else 0), note)


class RouterSum(LinearSum):
    """MoE router, softmax gating (dense or top-k, renormalised or not): ``sum_e W_router[e,:]``
    (+ ``sum_e b_router[e]``), vector of H. Adding one vector to every router row leaves softmax and
    its top-k ranking unchanged (spec: MoE router row). NOT valid for normalised-sigmoid gating with
    top_k >= 2 (spec: open row; see docs/router_sigmoid.md)."""

    family = "router_sum"
    source = SEED + " (MoE router)"


class Translation(LinearSum):
    """Untied softmax output layer: ``sum_v W_U[v,:]`` (+ ``sum_v b_U[v]``), vector of H. Only for losses
    invariant to adding a constant to all logits (softmax cross-entropy; Marcotte et al. 2025)."""

    family = "translation"
    source = "Marcotte, Gribonval, Peyre 2025"


class GainBalance(Law):
    """Pre-norm gain, feature c: ``(g_c + shift)^2 + beta_c^2 - sum_{M in readers} ||W_M[:,c]||^2``
    (vector of H). Readers: every linear map reading the normed vector (spec: pre-norm gain row);
    ``shift=1`` for gains stored as ``1 + w`` (Gemma)."""

    family = "gain"
    source = "derived (spec: pre-norm gain)"

    @classmethod
    def build(cls, name: str, layer: int | None, *, gain: Ref, readers: Sequence[Ref], beta: Ref | None = None,
              shift: float = 0.0, note: str = ""):
        bad = [r.param for r in readers if r.rows != gain.rows]
        if bad:
            raise ValueError(f"{name}: readers {bad} do not read {gain.rows} features")
        terms = [Term("norm", gain, +1.0, shift=shift)] + _norms([beta], +1.0) + _norms(readers, -1.0)
        return cls(name, layer, terms, gain.rows, note)


class ScaleLaw(Law):
    """Scale invariance: ``sum ||X||_F^2`` over the given blocks is conserved when the output does not
    depend on their common scale (per-head QK-norm: ``||Q_i||_F^2`` and ``||K_j||_F^2``; spec: breakers)."""

    family = "qk_scale"
    source = "derived (spec: QK-norm breaker)"

    @classmethod
    def build(cls, name: str, layer: int | None, *, blocks: Sequence[Ref | None], note: str = ""):
        return cls(name, layer, _norms(blocks, +1.0, stride=0), 1, note)


class QKNormGain(Law):
    """QK-norm gains (q_norm / k_norm weights, and biases for LayerNorm): scaling dim t of the q_norm output
    by c and of the k_norm output by 1/c leaves every score unchanged. Without RoPE, per dim t:
    ``g_q[t]^2 (+ b_q[t]^2) - g_k[t]^2 (- b_k[t]^2)``; with RoPE only equal scalings within a rotary pair
    commute with the rotation, so per pair p: ``sum_{t in p} (g_q[t]^2 - g_k[t]^2)`` (derived like the
    spec's RoPE row; terms built by the detectors, which know the layout)."""

    family = "qk_norm_gain"
    source = "derived (spec: QK-norm breaker + RoPE row)"

    @classmethod
    def build(cls, name: str, layer: int | None, *, plus: Sequence[Ref | None], minus: Sequence[Ref | None],
              note: str = ""):
        """Per-dim form (no RoPE): ``plus`` = q_norm gain (and bias), ``minus`` = k_norm gain (and bias)."""
        sizes = {r.rows for r in list(plus) + list(minus) if r is not None}
        if len(sizes) != 1:
            raise ValueError(f"{name}: q_norm and k_norm refs have different sizes {sorted(sizes)}")
        return cls(name, layer, _norms(plus, +1.0) + _norms(minus, -1.0), sizes.pop(), note)


class LayerScaleBalance(GainBalance):
    """LayerScale after a Linear, feature c: ``gamma_c^2 - ||W[c,:]||^2 - b[c]^2`` (vector of H).
    Symmetry: ``gamma_c -> s gamma_c``, row c of ``W`` and ``b[c] -> / s`` (diagonal rescaling through
    ``gamma * (W x + b)``; the deep-linear argument of Marcotte et al. 2023, diagonal case). Built with
    ``GainBalance.build(gain=gamma, beta=None, readers=[rows of W, bias])``."""

    family = "layer_scale"
    source = "derived (diagonal rescaling, as the spec's deep-linear row)"


class NormScaleLaw(ScaleLaw):
    """``||W||_F^2 + ||b||^2`` of a Linear whose whole output is normalised by a following RMSNorm /
    LayerNorm (a post-norm on a block output, Gemma2/3, OLMo2): ``norm(c y) = norm(y)`` for eps = 0, so
    scaling W and b by c is a symmetry (the QK-norm argument, applied to the block output). Built with
    ``NormScaleLaw.build(name, layer, blocks=[rows of W, b])``."""

    family = "norm_scale"
    source = "derived (spec: QK-norm breaker, applied to a post-norm)"


FAMILIES = {c.family: c for c in (SwiGLUUnit, ReLUUnit, ReLUPowerUnit, QKGram, VOGram, RopePassGram, DeepLinearGram,
                                  RopePairs, RouterSum, Translation, GainBalance, ScaleLaw, QKNormGain, LayerScaleBalance,
                                  NormScaleLaw)}
