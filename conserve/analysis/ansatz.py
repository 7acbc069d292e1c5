"""The unknowns of ``conserve.discover`` and the linear algebra on them (float64, no nn.Module knowledge).

- fibers: the rows and columns of every parameter (``lead + (out, in)``; a vector as ``(n, 1)``) or, for
  the dense ansatz, every scalar; grouped in families of equal length;
- quadratic features ``<U_a, U_b>`` over fiber pairs of one family (all tensors and tensor pairs, or
  single tensors), with the features that are linear combinations of others removed (in-order QR of
  their values at random points) and those combinations kept to pick sparse representatives (least L1);
- the null space of a constraint matrix at its largest singular-value gap (``conserve.counting`` rule) and
  the reduced row echelon form that splits laws with disjoint supports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..counting import gap_rank

__all__ = ["Fiber", "Family", "families", "structured_fibers", "dense_fibers", "QuadraticFeatures",
           "count_quadratic", "nullspace", "rref", "Basis", "l1_fit", "reduce_l1"]


@dataclass(frozen=True)
class Fiber:
    """A row, a column or an entry of a parameter, as a vector of flat indices into ``theta``.

    ``kind``: ``row`` (``W[lead, a, :]``), ``col`` (``W[lead, :, a]``), ``entry`` (``b[a]`` of a vector,
    or one scalar in the dense ansatz: ``lead`` is then its full multi-index), ``vector`` (a whole 1-D
    parameter) or ``scalar`` (a 0-dim parameter)."""

    param: str
    kind: str
    lead: tuple[int, ...]
    index: int
    length: int

    def label(self) -> str:
        lead = "".join(f"[{i}]" for i in self.lead)
        if self.kind == "row":
            return f"{self.param}{lead}[{self.index},:]"
        if self.kind == "col":
            return f"{self.param}{lead}[:,{self.index}]"
        if self.kind == "entry":
            return f"{self.param}[{','.join(map(str, self.lead))}]" if self.lead else f"{self.param}[{self.index}]"
        return self.param


def structured_fibers(names, shapes, offsets, include) -> tuple[list[Fiber], list[torch.Tensor]]:
    fibers, idxs = [], []
    for name, shape, off in zip(names, shapes, offsets):
        if name not in include:
            continue
        n = math.prod(shape)
        flat = off + torch.arange(n)
        if len(shape) == 0:
            fibers.append(Fiber(name, "scalar", (), 0, 1))
            idxs.append(flat)
            continue
        if len(shape) == 1:
            for a in range(shape[0]):
                fibers.append(Fiber(name, "entry", (), a, 1))
                idxs.append(flat[a : a + 1])
            if shape[0] > 1:
                fibers.append(Fiber(name, "vector", (), 0, shape[0]))
                idxs.append(flat)
            continue
        grid = flat.reshape(shape)
        lead_shape, (out, inn) = tuple(shape[:-2]), tuple(shape[-2:])
        leads = list(_multi_indices(lead_shape))
        for lead in leads:
            for a in range(out):
                fibers.append(Fiber(name, "row", lead, a, inn))
                idxs.append(grid[lead][a, :])
        if not (out == 1 and inn == 1):
            for lead in leads:
                for c in range(inn):
                    fibers.append(Fiber(name, "col", lead, c, out))
                    idxs.append(grid[lead][:, c])
    return fibers, idxs


def dense_fibers(names, shapes, offsets, include) -> tuple[list[Fiber], list[torch.Tensor]]:
    fibers, idxs = [], []
    for name, shape, off in zip(names, shapes, offsets):
        if name not in include:
            continue
        for k, mi in enumerate(_multi_indices(tuple(shape))):
            fibers.append(Fiber(name, "entry" if shape else "scalar", tuple(mi) if len(shape) != 1 else (), mi[0] if len(shape) == 1 else k, 1))
            idxs.append(torch.tensor([off + k]))
    return fibers, idxs


def _multi_indices(shape: tuple[int, ...]):
    if not shape:
        yield ()
        return
    for flat in range(math.prod(shape)):
        out = []
        for s in reversed(shape):
            out.append(flat % s)
            flat //= s
        yield tuple(reversed(out))


@dataclass
class Family:
    length: int
    fibers: list[int]  # global fiber ids, in fiber order
    idx: torch.Tensor  # (n, L) flat indices into theta


def families(fibers: list[Fiber], idxs: list[torch.Tensor]) -> list[Family]:
    by_len: dict[int, list[int]] = {}
    for i, f in enumerate(fibers):
        by_len.setdefault(f.length, []).append(i)
    return [Family(L, ids, torch.stack([idxs[i] for i in ids])) for L, ids in sorted(by_len.items())]



def nullspace(A: torch.Tensor) -> tuple[torch.Tensor, int, float, float, list[float]]:
    """Null space of ``A`` (rows normalised, columns equilibrated) at the largest singular-value gap."""
    rn = A.norm(dim=1, keepdim=True)
    A = A / torch.where(rn > 0, rn, torch.ones_like(rn))
    cn = A.norm(dim=0)
    # equilibrate columns, but never blow up a column that is rounding noise (a zero gradient)
    cn = cn.clamp_min(1e-6 * float(cn.max()) if float(cn.max()) > 0 else 1.0)
    A = A / cn
    n = A.shape[1]
    if A.abs().max() == 0:
        return torch.eye(n, dtype=A.dtype), 0, math.inf, 1.0, []
    if A.shape[0] < n:  # pragma: no cover - the callers always ask for more rows than unknowns
        raise RuntimeError("discover: fewer constraints than unknowns")
    _, s, vh = torch.linalg.svd(A, full_matrices=False)
    rank, gap, second = gap_rank(s, A.shape)
    around = [float(v) for v in s[max(0, rank - 3) : rank + 3]]
    null = vh[rank:].T / cn[:, None]  # back to the unscaled unknowns
    return null, rank, gap, second, around


def rref(B: torch.Tensor, tol: float = 1e-7) -> torch.Tensor:
    """Reduced row echelon form of the rows of ``B`` (k, N) (partial pivoting, columns in order); tiny
    entries (< 1e-9 of the pivot) are set to zero. Laws with disjoint supports come out separated."""
    B = B.clone()
    k, n = B.shape
    if k == 0:
        return B
    B = B / B.abs().amax(dim=1, keepdim=True)
    r = 0
    for col in range(n):
        if r == k:
            break
        sub = B[r:, col].abs()
        i = int(torch.argmax(sub))
        if float(sub[i]) <= tol:
            continue
        if i:
            B[[r, r + i]] = B[[r + i, r]]
        B[r] = B[r] / B[r, col]
        others = torch.ones(k, dtype=torch.bool)
        others[r] = False
        B[others] -= B[others, col : col + 1] * B[r]
        r += 1
    B[B.abs() < 1e-9] = 0.0
    return B[:r]


def _owner(f: Fiber) -> str:
    return f.param


def count_quadratic(fams: list[Family], fibers: list[Fiber], within: bool) -> int:
    if not within:
        return sum(len(F.fibers) * (len(F.fibers) + 1) // 2 for F in fams)
    n = 0
    for F in fams:
        per: dict[str, int] = {}
        for i in F.fibers:
            per[_owner(fibers[i])] = per.get(_owner(fibers[i]), 0) + 1
        n += sum(v * (v + 1) // 2 for v in per.values())
    return n


class QuadraticFeatures:
    """Quadratic features ``<U_a, U_b>`` over families of equal-length fibers.

    All features (sorted by first, then second fiber) are kept for evaluation; ``kept`` indexes the
    independent ones that are the unknowns; ``trivial`` holds the combinations of features that vanish
    identically (e.g. ``sum_a ||W[a,:]||^2 - sum_c ||W[:,c]||^2``), used to pick sparse representatives."""

    def __init__(self, fibers, idxs, independent_check: bool, P: int, within: bool = False):
        self.fibers = fibers
        self.fams = families(fibers, idxs)
        fa, fb, fam, pa, pb = [], [], [], [], []
        for k, F in enumerate(self.fams):
            n = len(F.fibers)
            iu = torch.triu_indices(n, n)
            ids = torch.tensor(F.fibers)
            if within:  # pairs of fibers of the same tensor only
                names = {}
                owner = torch.tensor([names.setdefault(_owner(fibers[i]), len(names)) for i in F.fibers])
                iu = iu[:, owner[iu[0]] == owner[iu[1]]]
            fa.append(ids[iu[0]]), fb.append(ids[iu[1]])
            fam.append(torch.full((iu.shape[1],), k)), pa.append(iu[0]), pb.append(iu[1])
        fa, fb = torch.cat(fa), torch.cat(fb)
        order = torch.argsort(fa * (len(fibers) + 1) + fb)
        self.fa, self.fb = fa[order], fb[order]
        self.fam, self.pa, self.pb = torch.cat(fam)[order], torch.cat(pa)[order], torch.cat(pb)[order]
        self.kept = torch.arange(self.n_all)
        self.trivial: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.index = {(int(a), int(b)): i for i, (a, b) in enumerate(zip(self.fa.tolist(), self.fb.tolist()))}
        if independent_check:
            self._drop_dependent(P)

    @property
    def n_all(self) -> int:
        return int(self.fa.numel())

    @property
    def n(self) -> int:
        return int(self.kept.numel())

    @property
    def removed(self) -> int:
        return self.n_all - self.n

    def values(self, theta: torch.Tensor, sel: torch.Tensor | None = None) -> torch.Tensor:
        """Feature values ``<U_a, U_b>`` at points ``theta`` (S, P) -> (S, N_all) (or the features ``sel``)."""
        ids = torch.arange(self.n_all) if sel is None else sel
        out = torch.empty(theta.shape[0], ids.numel(), dtype=theta.dtype)
        fam = self.fam[ids]
        for k, F in enumerate(self.fams):
            m = fam == k
            if not m.any():
                continue
            U = theta[:, F.idx]  # (S, n, L)
            G = U @ U.transpose(1, 2)
            out[:, m] = G[:, self.pa[ids][m], self.pb[ids][m]]
        return out

    def rows(self, theta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Constraint rows ``d<U_a,U_b> . g`` (kept features) for gradients g (k, P) at theta (P,) -> (k, N)."""
        ids = self.kept
        out = torch.empty(g.shape[0], ids.numel(), dtype=g.dtype)
        fam = self.fam[ids]
        for k, F in enumerate(self.fams):
            m = fam == k
            if not m.any():
                continue
            U = theta[F.idx]  # (n, L)
            G = g[:, F.idx]  # (k, n, L)
            S = G @ U.T
            out[:, m] = (S + S.transpose(1, 2))[:, self.pa[ids][m], self.pb[ids][m]]
        return out

    def _drop_dependent(self, P: int) -> None:
        """Remove features that are linear combinations of earlier ones: in-order QR of their values at
        random points, per pair of tensors (features of different tensor pairs share no monomial)."""
        pf = [f.param for f in self.fibers]
        pidx = {p: i for i, p in enumerate(dict.fromkeys(pf))}
        pa = torch.tensor([pidx[pf[i]] for i in self.fa.tolist()], dtype=torch.long)
        pb = torch.tensor([pidx[pf[i]] for i in self.fb.tolist()], dtype=torch.long)
        key = pa * len(pidx) + pb
        keep = torch.ones(self.n_all, dtype=torch.bool)
        g = torch.Generator().manual_seed(12345)
        for kv in torch.unique(key).tolist():
            cols = (key == kv).nonzero().flatten()
            if cols.numel() < 2:
                continue
            theta = torch.randn(cols.numel() + 8, P, generator=g, dtype=torch.float64)
            V = self.values(theta, cols)
            nrm = V.norm(dim=0).clamp_min(1e-300)
            V = V / nrm
            R = torch.linalg.qr(V, mode="r")[1]
            dep = R.diagonal().abs() < 1e-8
            if not dep.any():
                continue
            keep[cols[dep]] = False
            _, sv, vh = torch.linalg.svd(V, full_matrices=False)
            nd = int(dep.sum())
            for t in rref(vh[-nd:]):
                nz = t.nonzero().flatten()
                tf = t[nz] / nrm[nz]
                self.trivial.append((cols[nz], tf / tf.abs().max()))
        self.kept = keep.nonzero().flatten()

    def inflate(self, row: torch.Tensor) -> torch.Tensor:
        """A law on the kept features -> all features, made sparse modulo the trivial combinations
        (least L1 norm over the combinations that touch it: a small linear program)."""
        full = torch.zeros(self.n_all, dtype=row.dtype)
        full[self.kept] = row
        support = set(full.nonzero().flatten().tolist())
        chosen: list[int] = []
        for _ in range(3):  # combinations touching the support, then those touching them
            more = [i for i, (idx, _) in enumerate(self.trivial) if i not in chosen and support.intersection(idx.tolist())]
            if not more:
                break
            chosen += more
            for i in more:
                support.update(self.trivial[i][0].tolist())
        if chosen:
            cols = sorted(support)
            pos = {c: j for j, c in enumerate(cols)}
            T = torch.zeros(len(cols), len(chosen), dtype=torch.float64)
            for j, i in enumerate(chosen):
                idx, t = self.trivial[i]
                for c, v in zip(idx.tolist(), t.tolist()):
                    T[pos[c], j] = v
            x = full[cols]
            lam = l1_fit(x, T)
            if lam is not None:
                full[cols] = x + T @ lam
        full[full.abs() < 1e-9] = 0.0
        return full


def l1_fit(x: torch.Tensor, T: torch.Tensor) -> torch.Tensor | None:
    """``argmin_lam ||x + T lam||_1`` (scipy's HiGHS linear program when scipy is installed, else iteratively
    reweighted least squares); near-integer ``lam`` snapped; ``None`` if it does not lower the L1 norm."""
    lam = _l1_linprog(x, T)
    if lam is None:
        lam = _l1_irls(x, T)
    lam = torch.where((lam - lam.round()).abs() < 1e-6, lam.round(), lam)
    if float((x + T @ lam).abs().sum()) >= float(x.abs().sum()) - 1e-12:
        return None
    return lam


def _l1_linprog(x: torch.Tensor, T: torch.Tensor) -> torch.Tensor | None:
    try:
        from scipy.optimize import linprog
    except ImportError:
        return None
    n, m = T.shape
    # variables [lam (m, free), u (n, >= 0)]; minimise sum u with -u <= x + T lam <= u
    c = torch.cat([torch.zeros(m), torch.ones(n)]).numpy()
    eye = torch.eye(n, dtype=torch.float64)
    A = torch.cat([torch.cat([T, -eye], 1), torch.cat([-T, -eye], 1)]).numpy()
    bnd = torch.cat([-x, x]).numpy()
    res = linprog(c, A_ub=A, b_ub=bnd, bounds=[(None, None)] * m + [(0, None)] * n, method="highs")
    return torch.tensor(res.x[:m], dtype=torch.float64) if res.success else None


def _l1_irls(x: torch.Tensor, T: torch.Tensor, iters: int = 200) -> torch.Tensor:
    """L1 regression by iteratively reweighted least squares (weights 1 / max(|r|, delta), delta -> 0)."""
    lam = torch.linalg.lstsq(T, -x[:, None]).solution.flatten()
    delta = 1.0
    for _ in range(iters):
        r = x + T @ lam
        w = 1.0 / r.abs().clamp_min(delta)
        sw = w.sqrt()[:, None]
        lam = torch.linalg.lstsq(sw * T, -(sw.flatten() * x)[:, None]).solution.flatten()
        delta = max(delta * 0.7, 1e-12)
    return lam


class Basis:
    """Incremental orthonormal basis (Gram-Schmidt, twice) of feature vectors."""

    def __init__(self, n: int):
        self.Q = torch.zeros(n, 0, dtype=torch.float64)

    @property
    def rank(self) -> int:
        return self.Q.shape[1]

    def add(self, v: torch.Tensor) -> bool:
        nv = float(v.norm())
        if nv == 0:
            return False
        r = v / nv
        for _ in range(2):
            r = r - self.Q @ (self.Q.T @ r)
        if float(r.norm()) < 1e-8:
            return False
        self.Q = torch.cat([self.Q, (r / r.norm())[:, None]], 1)
        return True




def reduce_l1(row: torch.Tensor, combos: list[torch.Tensor]) -> torch.Tensor:
    """``row + sum_j lam_j combos[j]`` of least L1 norm over the combinations that touch ``row``'s support
    (one level of closure): a sparse representative of ``row`` modulo their span."""
    support = set(row.nonzero().flatten().tolist())
    chosen: list[int] = []
    for _ in range(2):
        more = [j for j, c in enumerate(combos) if j not in chosen and support.intersection(c.nonzero().flatten().tolist())]
        if not more:
            break
        chosen += more
        for j in more:
            support.update(combos[j].nonzero().flatten().tolist())
    if not chosen:
        return row
    cols = torch.tensor(sorted(support))
    T = torch.stack([combos[j][cols] for j in chosen], 1)
    lam = l1_fit(row[cols], T)
    if lam is None:
        return row
    out = row.clone()
    out[cols] = row[cols] + T @ lam
    out[out.abs() < 1e-9] = 0.0
    return out
