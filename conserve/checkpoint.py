"""Read checkpoints on disk lazily: a local HF directory or one raw ``.safetensors`` file.

``open_checkpoint(path) -> Checkpoint``:

* a directory with ``config.json`` and ``model.safetensors``, or sharded ``model-0000x-of-0000y.safetensors``
  with ``model.safetensors.index.json`` (its ``weight_map`` names the shard of every tensor);
* one ``.safetensors`` file (``config`` is then the ``config.json`` beside it, if there is one, else None).

Only the safetensors headers are read on open (names, shapes, dtypes); tensors are read one at a time
with ``safetensors.safe_open`` when asked for. Every problem a user can fix (missing path, no weights,
a corrupt or truncated file, a shard named by the index but absent) raises ``conserve.errors.UsageError``
with a one-line message naming the file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

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

    @property
    def raw(self) -> bool:
        """True when there is no config: the architecture must come from tensor names and options."""
        return self.config is None

    def tensors(self, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Read ``names`` (checkpoint keys) onto ``device``, opening each file once."""
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
                         f"(first: {missing[:3]}); the config does not match the weights")
    return out
