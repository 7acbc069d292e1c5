"""Read checkpoints on disk lazily: a local HF directory or one raw ``.safetensors`` file.

``open_checkpoint(path) -> Checkpoint``:

* a directory with ``config.json`` and ``model.safetensors``, or sharded ``model-0000x-of-0000y.safetensors``
  with ``model.safetensors.index.json`` (its ``weight_map`` names the shard of every tensor);
* one ``.safetensors`` file (``config`` is then the ``config.json`` beside it, if there is one, else None).

Mixture-of-experts checkpoints written by ``save_pretrained`` keep one tensor per expert
(``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` for Mixtral, ``mlp.experts.{e}.gate/up/down_proj.weight``
for the Qwen2-MoE family, OLMoE, Qwen3-MoE), while the model in memory holds fused 3-D tensors
``experts.gate_up_proj (E, 2I, H)`` = stack_e [gate_e ; up_e] and ``experts.down_proj (E, H, I)``
(``is_transposed``: the last two dims swapped), as transformers' conversion mapping builds them on load.
``resolve(ck, param_shapes)`` maps model parameters onto the checkpoint: a name found as is (or with one
leading prefix added/removed) is read directly; a fused expert tensor is assembled from the per-expert
tensors (a ``Fused`` recipe: stacked, concatenated, transposed to the model's shape), or read from a fused
on-disk tensor stored in the other orientation (transposed on read); keys that transformers renames on load
(its conversion mapping, passed as ``rename``, e.g. GPT-NeoX ``embed_out`` -> ``lm_head``) are read under
the original name.

Only the safetensors headers are read on open (names, shapes, dtypes); tensors are read one at a time
with ``safetensors.safe_open`` when asked for. Every problem a user can fix (missing path, no weights,
a corrupt or truncated file, a shard named by the index but absent) raises ``conserve.errors.UsageError``
with a one-line message naming the file.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from .errors import UsageError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Checkpoint:
    """Tensor names, shapes and files of a checkpoint; tensors are read on demand.

    Attributes:
        path: what the user passed.
        config: the parsed ``config.json`` (a dict) or None for a raw file without one.
        files: tensor name -> safetensors file holding it.
        shapes: tensor name -> shape (from the headers). dtypes: tensor name -> safetensors dtype string.
    """

    path: Path
    config: dict | None
    files: dict[str, Path] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    fused: dict[str, "Fused"] = field(default_factory=dict)

    @property
    def raw(self) -> bool:
        """True when there is no config: the architecture must come from tensor names and options."""
        return self.config is None

    def tensors(self, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Read ``names`` (checkpoint keys, or keys of ``fused`` recipes) onto ``device``, opening each
        file once."""
        names = list(names)
        real = list(dict.fromkeys(k for n in names for k in (self.fused[n].keys() if n in self.fused else (n,))))
        raw = self._read(real, device)
        return {n: (self.fused[n].build(raw) if n in self.fused else raw[n]) for n in names}

    def _read(self, names: list[str], device) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.files:
                raise UsageError(f"{self.path}: no tensor named {n!r} in the checkpoint")
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        from safetensors import safe_open

        for f, ns in by_file.items():
            try:
                with safe_open(str(f), framework="pt", device=str(device)) as fh:
                    for n in ns:
                        out[n] = fh.get_tensor(n)
            except UsageError:
                raise
            except Exception as e:  # safetensors raises its own error types for truncated data
                raise UsageError(f"{f}: cannot read tensors ({e}); the file is corrupt or truncated, "
                                 "re-download or re-save it") from None
        return out


@dataclass(frozen=True)
class Fused:
    """A model tensor assembled from checkpoint tensors: ``stack_e cat(parts[e], dim=0)``, then the last
    two dims swapped when ``transpose`` (vectors: no transpose). One part per expert for ``down_proj``,
    two (gate, up) for ``gate_up_proj``; a single fused key with ``parts=((key,),)`` and ``stack=False``
    is only transposed."""

    parts: tuple[tuple[str, ...], ...]
    transpose: bool = False
    stack: bool = True

    def keys(self) -> list[str]:
        return [k for p in self.parts for k in p]

    def build(self, raw: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.stack:
            t = torch.stack([torch.cat([raw[k] for k in p], dim=0) for p in self.parts])
        else:
            t = raw[self.parts[0][0]]
        return t.transpose(-1, -2).contiguous() if self.transpose else t


# (gate, up, down) module names of per-expert gated MLPs in checkpoints, and the MoE module names on
# disk for the model's ``mlp`` (Mixtral saves ``block_sparse_moe``; transformers renames it on load)
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_MOE_ALIASES = (".mlp.", ".block_sparse_moe.")
_FUSED = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def _bases(model_prefix: str, keys) -> list[str]:
    """Checkpoint-side spellings of a model module path: MoE aliases x one leading prefix removed/added."""
    out = []
    for a in _MOE_ALIASES:
        for b in _MOE_ALIASES:
            cand = (model_prefix + ".").replace(a, b, 1)[:-1]
            out += [cand, cand.split(".", 1)[1] if "." in cand else cand]
    first = {k.split(".", 1)[0] for k in keys if "." in k}
    out += [f"{f}.{c}" for f in sorted(first) for c in list(out)]
    return list(dict.fromkeys(out))


def _fused_recipe(name: str, shape: tuple[int, ...], ck: "Checkpoint") -> tuple[Fused, tuple[int, ...]] | None:
    """How to build the model's fused expert tensor ``name`` (shape ``shape``) from ``ck``, or None."""
    m = _FUSED.match(name)
    if m is None:
        return None
    pre, what, bias = m.group(1), m.group(2), bool(m.group(3))
    suffix = "bias" if bias else "weight"
    for base in _bases(pre, ck.shapes):
        # fused on disk, in the other orientation
        k = f"{base}.experts.{what}{'_bias' if bias else ''}"
        if not bias and k in ck.shapes and len(shape) == 3 and ck.shapes[k] == shape[:1] + shape[1:][::-1] \
                and shape[1] != shape[2]:
            return Fused(((k,),), transpose=True, stack=False), shape
        for gate, up, down in _EXPERT_NAMES:
            names = (gate, up) if what == "gate_up_proj" else (down,)
            parts, e = [], 0
            while all(f"{base}.experts.{e}.{n}.{suffix}" in ck.shapes for n in names):
                parts.append(tuple(f"{base}.experts.{e}.{n}.{suffix}" for n in names))
                e += 1
            if not parts:
                continue
            one = [ck.shapes[k] for k in parts[0]]
            if bias:
                built = (len(parts), sum(s[0] for s in one))
                return (Fused(tuple(parts)), built) if built == tuple(shape) else None
            built = (len(parts), sum(s[0] for s in one), one[0][1])
            if built == tuple(shape):
                return Fused(tuple(parts)), built
            if built[:1] + built[1:][::-1] == tuple(shape):
                return Fused(tuple(parts), transpose=True), tuple(shape)
            return None
    return None


def resolve(ck: "Checkpoint", params: Mapping[str, Sequence[int]], rename=None) -> dict[str, str]:
    """``{model parameter: checkpoint key}`` for ``params`` (name -> shape of the model's parameter).

    Names are matched as in ``match_names``; a fused expert tensor of the model that the checkpoint stores
    per expert (or fused in the other orientation) gets a ``Fused`` recipe in ``ck.fused`` under the
    model's own name. ``rename(key) -> key``: the on-load renaming of checkpoint keys (transformers'
    conversion mapping, e.g. GPT-NeoX ``embed_out`` -> ``lm_head``); a parameter found under a renamed key
    reads the original one. Raises UsageError naming the parameters that have no tensor."""
    renamed: dict[str, str] = {}
    if rename is not None:
        for k in list(ck.shapes):
            r = rename(k)
            if r != k and r not in ck.shapes:
                renamed[r] = k
    for n, shape in params.items():
        shape = tuple(shape)
        if n in ck.shapes:
            have = ck.shapes[n]
            if (have != shape and n not in ck.fused and _FUSED.match(n) and len(shape) == 3 and shape[1] != shape[2]
                    and have == shape[:1] + shape[1:][::-1]):
                ck.fused[n] = Fused(((n,),), transpose=True, stack=False)  # fused on disk, other orientation
                ck.shapes[n] = shape
            continue
        alias = next((renamed[x] for x in (n, *(k for k in renamed if _strip_eq(n, k))) if x in renamed), None)
        if alias is not None and ck.shapes[alias] == shape:
            ck.fused[n] = Fused(((alias,),), stack=False)
            ck.shapes[n], ck.dtypes[n], ck.files[n] = shape, ck.dtypes[alias], ck.files[alias]
            continue
        if any(_strip_eq(n, k) for k in ck.shapes):
            continue  # match_names reads it directly
        r = _fused_recipe(n, shape, ck)
        if r is None:  # a module renamed on load (Mixtral: block_sparse_moe -> mlp)
            mod, leaf = n.rsplit(".", 1) if "." in n else ("", n)
            alias = next((f"{b}.{leaf}" for b in _bases(mod, ck.shapes) if f"{b}.{leaf}" in ck.shapes
                          and ck.shapes[f"{b}.{leaf}"] == shape), None)
            r = (Fused(((alias,),), stack=False), shape) if alias is not None else None
        if r is not None:
            recipe, built = r
            ck.fused[n] = recipe
            ck.shapes[n] = built
            ck.dtypes[n] = ck.dtypes[recipe.parts[0][0]]
            ck.files[n] = ck.files[recipe.parts[0][0]]
    return match_names(params, ck.shapes)


def _strip_eq(n: str, k: str) -> bool:
    """``k`` is ``n`` with one leading component added or removed (match_names would read it directly)."""
    return (k.endswith("." + n)) or (n.endswith("." + k))


# safetensors dtype strings whose values are not the weights themselves
_NOT_FLOAT = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F8_E4M3", "F8_E5M2", "F8_E8M0",
              "F4", "F6_E2M3", "F6_E3M2")


def check_float(ck: "Checkpoint", keys: Iterable[str]) -> None:
    """Refuse integer / bool / 8-bit-float (quantised) tensors and quantised checkpoints (one-line
    UsageError naming the first tensor and the fix): their stored values are codes, not the weights."""
    q = (ck.config or {}).get("quantization_config")
    if q:
        raise UsageError(f"{ck.path}: a quantised checkpoint (quantization_config: "
                         f"{q.get('quant_method', q) if isinstance(q, dict) else q}): its tensors are codes, not weights; "
                         "dequantise it first (load with from_pretrained and save_pretrained in bfloat16 or float32)")
    for k in keys:
        real = ck.fused[k].keys() if k in ck.fused else [k]
        for r in real:
            dt = ck.dtypes.get(r, "")
            if dt.upper() in _NOT_FLOAT:
                raise UsageError(f"{ck.path}: tensor {r!r} has dtype {dt} (integer, bool or quantised): law values of "
                                 "such weights are meaningless; dequantise it (save the model in bfloat16 or float32) "
                                 "and inspect that checkpoint")


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """``{name: (NaN count, Inf count)}`` of the floating tensors that are not all finite."""
    out = {}
    for n, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            out[n] = (int(torch.isnan(t).sum()), int(torch.isinf(t).sum()))
    return out


def describe_nonfinite(bad: Mapping[str, tuple[int, int]], shapes: Mapping[str, Sequence[int]] | None = None) -> str:
    """``'a.weight: 3 NaN, 0 Inf (of 64); ...'`` (at most 5 named)."""
    def size(n):
        if not shapes or n not in shapes:
            return ""
        k = 1
        for d in shapes[n]:
            k *= d
        return f" (of {k})"

    items = [f"{n}: {a} NaN, {b} Inf{size(n)}" for n, (a, b) in bad.items()]
    return "; ".join(items[:5]) + (f"; ... ({len(items) - 5} more)" if len(items) > 5 else "")


def _header(f: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as fh:
            shapes, dtypes = {}, {}
            for k in fh.keys():
                sl = fh.get_slice(k)
                shapes[k] = tuple(sl.get_shape())
                dtypes[k] = sl.get_dtype()
            return shapes, dtypes
    except FileNotFoundError:
        raise UsageError(f"{f}: file not found") from None
    except Exception as e:
        raise UsageError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e}); "
                         "re-download or re-save it") from None


def _read_json(f: Path) -> dict:
    try:
        out = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{f}: not valid JSON ({e}); fix or re-download it") from None
    if not isinstance(out, dict):
        raise UsageError(f"{f}: expected a JSON object")
    return out


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a checkpoint directory or ``.safetensors`` file (see the module docstring). Raises UsageError."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such file or directory; pass an HF checkpoint directory "
                         "(config.json + *.safetensors) or a .safetensors file")
    if p.is_dir():
        cfg_file = p / "config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else None
        if config is None:
            raise UsageError(f"{p}: no config.json in the directory; pass the .safetensors file itself "
                             "(with --num-heads/--rope-layout) or add the model's config.json")
        if (p / INDEX).is_file():
            wm = _read_json(p / INDEX).get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise UsageError(f"{p / INDEX}: no 'weight_map'; re-save the checkpoint")
            shards = sorted(set(wm.values()))
        elif (p / SINGLE).is_file():
            shards = [SINGLE]
        else:
            found = sorted(x.name for x in p.glob("*.safetensors"))
            if len(found) == 1:
                shards = found
            else:
                raise UsageError(f"{p}: no {SINGLE} (or {INDEX} for shards) found"
                                 + (f"; found {found}" if found else "; only safetensors weights are read "
                                    "(convert .bin with `model.save_pretrained(dir, safe_serialization=True)`)"))
        ck = Checkpoint(p, config)
        for s in shards:
            f = p / s
            if not f.is_file():
                raise UsageError(f"{f}: shard named in {INDEX} is missing; re-download the checkpoint")
            shapes, dtypes = _header(f)
            for k in shapes:
                ck.files[k] = f
            ck.shapes.update(shapes)
            ck.dtypes.update(dtypes)
        return ck
    if p.suffix != ".safetensors":
        raise UsageError(f"{p}: not a .safetensors file or a checkpoint directory")
    cfg_file = p.parent / "config.json"
    ck = Checkpoint(p, _read_json(cfg_file) if cfg_file.is_file() else None)
    shapes, dtypes = _header(p)
    ck.files = {k: p for k in shapes}
    ck.shapes, ck.dtypes = shapes, dtypes
    return ck


def match_names(params: Iterable[str], keys: Mapping[str, object] | Iterable[str]) -> dict[str, str]:
    """Map model parameter names to checkpoint keys that differ by one leading prefix.

    HF checkpoints of ``*ForCausalLM`` models store ``model.layers.0...`` (the names of the full model);
    a checkpoint of the base model (or an old GPT-2 one) has ``layers.0...`` / ``h.0...``. The one prefix
    (added or removed) that matches the most names is used. Raises UsageError naming the first
    parameters that have no tensor."""
    params = list(params)
    keys = set(keys)
    candidates = {("", "")}
    for n in params:
        if "." in n:
            candidates.add((n.split(".", 1)[0] + ".", ""))  # strip from the param name
    for k in keys:
        if "." in k:
            candidates.add(("", k.split(".", 1)[0] + "."))  # add to the param name

    def apply(n, c):
        strip, add = c
        return add + n[len(strip):] if n.startswith(strip) else None

    best = max(sorted(candidates), key=lambda c: sum(apply(n, c) in keys for n in params))
    out, missing = {}, []
    for n in params:
        k = n if n in keys else apply(n, best)
        if k in keys:
            out[n] = k
        else:
            missing.append(n)
    if missing:
        raise UsageError(f"{len(missing)} parameter(s) of the detected laws have no tensor in the checkpoint "
                         f"(first: {missing[:3]}): the weights are not those of the model the config describes (another "
                         "model's checkpoint, or a config from elsewhere); pass checkpoints of the same model")
    return out
