"""LoRA / PEFT adapters (conserve/detection/lora.py; spec ``shared/spec/laws.md``, catalogue row "LoRA adapter").

``peft`` is not a dependency: ``PeftLinear`` / ``PeftEmbedding`` / ``PeftConv2d`` below reproduce PEFT's module
structure and parameter names (``base_layer``; ``lora_A`` / ``lora_B`` ``nn.ModuleDict`` keyed by adapter name;
``lora_dropout``; ``scaling``; ``lora_embedding_A`` / ``lora_embedding_B`` ``nn.ParameterDict``; DoRA's
``lora_magnitude_vector``; ``active_adapters`` / ``disable_adapters`` / ``merged_adapters``) and ``PeftModel`` the
wrapper's paths (``base_model.model.<model>``). ``LitLoRALinear`` is a plain-torch LoRA layer as litgpt writes it
(``linear`` + ``lora_A`` / ``lora_B`` parameters), ``LoralibLinear`` as loralib (an ``nn.Linear`` subclass).

Every claimed law passes the float64 first-order check on the model's own forward; the adapter laws are tracked
through an optimizer over the adapters only (base frozen) with the exact GD drift identity."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conserve
from conserve.analysis.verify import TOL, first_order
from conserve.detection import detect
from conserve.laws import DeepLinearGram, evaluate_laws

WRONG = 1e-6


# --------------------------------------------------------------------------- PEFT's structure, reproduced
class PeftLinear(nn.Module):
    """PEFT ``lora.Linear``: ``base_layer(x) + sum_active lora_B[a](lora_A[a](dropout[a](x))) * scaling[a]``;
    DoRA (``use_dora``): the output rows renormalised by the detached ``||W + s B A||`` and a magnitude."""

    def __init__(self, base: nn.Linear, adapters: dict, dropout: float = 0.1, dora: bool = False, lora_bias=False):
        super().__init__()
        self.base_layer = base
        self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.lora_magnitude_vector = nn.ModuleDict()
        self.scaling, self.use_dora = {}, {}
        for name, (r, alpha) in adapters.items():
            self.lora_A[name] = nn.Linear(base.in_features, r, bias=False)
            self.lora_B[name] = nn.Linear(r, base.out_features, bias=lora_bias)
            self.lora_dropout[name] = nn.Dropout(dropout) if dropout else nn.Identity()
            self.scaling[name] = alpha / r
            self.use_dora[name] = dora
            if dora:
                mag = nn.Module()
                mag.weight = nn.Parameter(base.weight.detach().norm(dim=1).clone())
                self.lora_magnitude_vector[name] = mag
        self.active_adapters = list(adapters)
        self.disable_adapters = False
        self.merged_adapters: list[str] = []

    def forward(self, x):
        result = self.base_layer(x)
        if self.disable_adapters:
            return result
        for name in self.active_adapters:
            if name not in self.lora_A or name in self.merged_adapters:
                continue
            a, b, s = self.lora_A[name], self.lora_B[name], self.scaling[name]
            h = self.lora_dropout[name](x)
            if not self.use_dora[name]:
                result = result + b(a(h)) * s
            else:  # PEFT DoraLinearLayer: the weight norm is detached
                w = self.base_layer.weight + s * b.weight @ a.weight
                norm = w.norm(dim=1).detach()
                scale = (self.lora_magnitude_vector[name].weight / norm).view(1, -1)
                base_out = F.linear(h, self.base_layer.weight)
                result = result - base_out + (scale - 1) * base_out + scale * b(a(h)) * s + base_out
        return result


class PeftEmbedding(nn.Module):
    """PEFT ``lora.Embedding``: ``lora_embedding_A`` (r, num_embeddings), ``lora_embedding_B`` (dim, r)."""

    def __init__(self, base: nn.Embedding, r: int, alpha: float, name: str = "default"):
        super().__init__()
        self.base_layer = base
        self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
        self.lora_embedding_A = nn.ParameterDict({name: nn.Parameter(torch.randn(r, base.num_embeddings))})
        self.lora_embedding_B = nn.ParameterDict({name: nn.Parameter(torch.randn(base.embedding_dim, r))})
        self.scaling = {name: alpha / r}
        self.active_adapters = [name]

    def forward(self, x):
        out = self.base_layer(x)
        for name in self.active_adapters:
            a = F.embedding(x, self.lora_embedding_A[name].T)
            out = out + (a @ self.lora_embedding_B[name].T) * self.scaling[name]
        return out


class PeftConv2d(nn.Module):
    """PEFT ``lora.Conv2d``: ``lora_A`` a conv in -> r with the base kernel, ``lora_B`` a 1x1 conv r -> out."""

    def __init__(self, base: nn.Conv2d, r: int, alpha: float, name: str = "default"):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({name: nn.Conv2d(base.in_channels, r, base.kernel_size, base.stride,
                                                     base.padding, bias=False)})
        self.lora_B = nn.ModuleDict({name: nn.Conv2d(r, base.out_channels, 1, bias=False)})
        self.lora_dropout = nn.ModuleDict({name: nn.Dropout(0.1)})
        self.scaling = {name: alpha / r}
        self.active_adapters = [name]

    def forward(self, x):
        out = self.base_layer(x)
        for name in self.active_adapters:
            out = out + self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x))) * self.scaling[name]
        return out


class LoraModel(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *a, **k):
        return self.model(*a, **k)


class PeftModel(nn.Module):
    """``PeftModel(base_model=LoraModel(model=...))``: parameter names ``base_model.model.<model's names>``."""

    def __init__(self, model):
        super().__init__()
        self.base_model = LoraModel(model)

    def forward(self, *a, **k):
        return self.base_model(*a, **k)


def inject(model: nn.Module, targets, *, freeze: bool = True, **kw) -> nn.Module:
    """``get_peft_model``: every nn.Linear whose name ends with one of ``targets`` wrapped, the base frozen."""
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    for path, m in list(model.named_modules()):
        for name, child in list(m.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(m, name, PeftLinear(child, **kw))
    return model


# ------------------------------------------------------------------------------- plain-torch LoRA
class LitLoRALinear(nn.Module):
    """litgpt ``LoRALinear``: ``linear(x) + (dropout(x) @ lora_A.T @ lora_B.T) * scaling``."""

    def __init__(self, i, o, r=3, alpha=6, dropout=0.1):
        super().__init__()
        self.linear = nn.Linear(i, o)
        self.lora_A = nn.Parameter(torch.randn(r, i))
        self.lora_B = nn.Parameter(torch.randn(o, r))
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = alpha / r

    def forward(self, x):
        return self.linear(x) + (self.lora_dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scaling


class LoralibLinear(nn.Linear):
    """loralib ``Linear``: an nn.Linear subclass with ``lora_A`` (r, in) / ``lora_B`` (out, r) parameters."""

    def __init__(self, i, o, r=2, alpha=4):
        super().__init__(i, o)
        self.lora_A = nn.Parameter(torch.randn(r, i))
        self.lora_B = nn.Parameter(torch.randn(o, r))
        self.scaling = alpha / r

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


class TorchtuneLoRALinear(nn.Module):
    """torchtune ``LoRALinear``: its own ``weight`` / ``bias`` and ``lora_a`` / ``lora_b`` nn.Linear modules."""

    def __init__(self, i, o, rank=2, alpha=4.0, dropout=0.1):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i))
        self.bias = nn.Parameter(torch.randn(o))
        self.lora_a = nn.Linear(i, rank, bias=False)
        self.lora_b = nn.Linear(rank, o, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.scaling = alpha / rank

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + self.scaling * self.lora_b(self.lora_a(self.dropout(x)))


# ------------------------------------------------------------------------------------------ helpers
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """float64, every parameter (adapters included: PEFT zero-inits B) of unit scale."""
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / max(p.shape[-1], 1) ** 0.5
                    + (1.0 if p.dim() == 1 and "norm" in name else 0.0))
    return model


def reasons(found) -> dict[str, str]:
    return {d.module: d.block + ": " + d.reason for d in found.declined}


def mlp(d=6, h=10, o=4):
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o))


def x_mlp(n=5, d=6, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def all_hold(model, laws, x):
    model.eval()  # dropout off for the check's forward (the law holds with it: test_dropout_keeps_the_law)
    bad = {law.name: v for law in laws if (v := first_order(model, law, x, trials=2)) > TOL}
    assert not bad, bad


# -------------------------------------------------------------------------------------------- tests
def test_peft_mlp_frozen_base_adapter_laws_only():
    m = randomize(PeftModel(inject(mlp(), ("0", "2"), adapters={"default": (3, 6)})))
    d = detect(m)
    assert d.detector.startswith("lora+") and d.undetected == []
    assert d.families() == {"deep_linear": 2}
    names = [law.name for law in d.laws]
    assert names == ["base_model.model.0/lora.default", "base_model.model.2/lora.default"]
    law = d.laws[0]
    assert isinstance(law, DeepLinearGram) and law.size == 3
    assert law.params == ("base_model.model.0.lora_A.default.weight", "base_model.model.0.lora_B.default.weight")
    r = reasons(d)
    frozen = [k for k, v in r.items() if "frozen" in v]
    assert "base_model.model.0-2/unit" in frozen and "base_model.model.2-4/unit" in frozen
    assert "base_model.model.0.base_layer.weight" in r["base_model.model.0-2/unit"]  # the model's own names
    all_hold(m, d.laws, x_mlp())
    # the value is A A^T - B^T B
    p = dict(m.named_parameters())
    A, B = p["base_model.model.0.lora_A.default.weight"], p["base_model.model.0.lora_B.default.weight"]
    torch.testing.assert_close(evaluate_laws([law], p, fp64=True)[law.name], A @ A.T - B.T @ B)


def test_wrong_laws_fail():
    m = randomize(PeftModel(inject(mlp(), ("0",), adapters={"default": (3, 6)})))
    m.eval()
    a, b = "base_model.model.0.lora_A.default.weight", "base_model.model.0.lora_B.default.weight"
    from conserve.laws import cols, rows

    bad = {"sign": DeepLinearGram.build("bad", 0, plus=[rows(a, (3, 6), 0, 3)], minus=[]),
           "B rows": DeepLinearGram.build("bad", 0, plus=[rows(a, (3, 6), 0, 3)], minus=[rows(b, (10, 3), 0, 3)]),
           "A^T A": DeepLinearGram.build("bad", 0, plus=[cols(a, (3, 6), 0, 3)], minus=[cols(b, (10, 3), 0, 3)])}
    for what, law in bad.items():
        assert first_order(m, law, x_mlp()) > WRONG, what


def test_multiple_adapters_dropout_scaling_and_inactive_ones():
    m = randomize(PeftModel(inject(mlp(), ("2",), adapters={"a": (2, 4), "b": (5, 1)}, dropout=0.3, lora_bias=True)))
    layer = m.base_model.model[2]
    d = detect(m)
    assert sorted(law.name for law in d.laws) == ["base_model.model.2/lora.a", "base_model.model.2/lora.b"]
    assert [law.size for law in sorted(d.laws, key=lambda x: x.name)] == [2, 5]
    all_hold(m, d.laws, x_mlp())
    layer.active_adapters = ["a"]
    for p in layer.lora_A["b"].parameters():
        p.requires_grad_(False)
    d = detect(m)
    assert [law.name for law in d.laws] == ["base_model.model.2/lora.a"]
    assert "not an active adapter" in reasons(d)["base_model.model.2/lora.b"] and d.undetected == []
    layer.merged_adapters = ["a"]
    d = detect(m)
    assert d.laws == [] and "merged" in reasons(d)["base_model.model.2/lora.a"]


class ModulesToSaveWrapper(nn.Module):
    """PEFT ``modules_to_save``: a frozen original and the trainable copy the forward uses."""

    def __init__(self, mod):
        super().__init__()
        self.original_module = mod
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(mod)})
        self.active_adapter = "default"
        for p in self.modules_to_save.parameters():
            p.requires_grad_(True)

    def forward(self, x):
        return self.modules_to_save[self.active_adapter](x)


def test_peft_modules_to_save():
    net = inject(mlp(), ("0",), adapters={"default": (3, 6)})
    net[4] = ModulesToSaveWrapper(net[4])
    m = randomize(PeftModel(net))
    d = detect(m)
    r = reasons(d)
    assert [law.name for law in d.laws] == ["base_model.model.0/lora.default"] and d.undetected == []
    assert "original copy" in r["base_model.model.4.original_module"]
    assert "frozen" in r["base_model.model.2-4/unit"] and "modules_to_save" not in r["base_model.model.2-4/unit"]
    for p in m.base_model.model[2].parameters():  # train Linear 2 too: its law with the trainable copy holds
        p.requires_grad_(True)
    d = detect(m)
    unit = next(law for law in d.laws if law.name == "base_model.model.2-4/unit")
    assert "base_model.model.4.modules_to_save.default.weight" in unit.params
    all_hold(m, d.laws, x_mlp())


def test_dropout_keeps_the_law():
    """In training mode (dropout masks drawn inside the forward) the law still holds: the check's two gradients
    use one mask per call, the same mask for A and B, and h depends on theta only."""
    m = randomize(PeftModel(inject(mlp(), ("0",), adapters={"default": (3, 6)}, dropout=0.5))).train()
    law = detect(m).laws[0]
    torch.manual_seed(0)
    x = x_mlp()
    p = dict(m.named_parameters())
    h = evaluate_laws([law], p, fp64=True)[law.name]
    gh = torch.autograd.grad((h * torch.randn_like(h)).sum(), [p[n] for n in law.params], allow_unused=True)
    out = m(x)
    gf = torch.autograd.grad((out * torch.randn_like(out)).sum(), [p[n] for n in law.params])
    dot = sum((a * b).sum() for a, b in zip(gh, gf))
    assert abs(dot) <= 1e-12 * math.sqrt(sum(a.pow(2).sum() for a in gh) * sum(b.pow(2).sum() for b in gf))


def test_dora_keeps_the_adapter_law_and_declines_extended_base_laws():
    m = randomize(PeftModel(inject(mlp(), ("0",), adapters={"default": (3, 6)}, dora=True, freeze=False)))
    d = detect(m)
    assert "base_model.model.0/lora.default" in [law.name for law in d.laws]
    assert "DoRA" in reasons(d)["base_model.model.0-2/unit"]
    assert d.undetected == []  # the magnitude: in no law, understood
    all_hold(m, d.laws, x_mlp())


def test_trainable_base_laws_are_extended_with_the_adapters():
    """Base trained with the adapters: the unit law of Linear 0 -> ReLU -> Linear 2 gains ``||B0[u,:]||^2`` (rows
    of 0's adapter B) and ``-||A2[:,u]||^2`` (columns of 2's adapter A); without them it fails."""
    m = randomize(PeftModel(inject(mlp(), ("0", "2"), adapters={"default": (3, 6)}, freeze=False)))
    d = detect(m)
    unit = next(law for law in d.laws if law.name == "base_model.model.0-2/unit")
    assert {"base_model.model.0.lora_B.default.weight", "base_model.model.2.lora_A.default.weight"} <= set(unit.params)
    assert d.families() == {"deep_linear": 2, "relu": 2} and d.undetected == []
    x = x_mlp()
    all_hold(m, d.laws, x)
    base_only = unit.__class__(unit.name, unit.layer, [t for t in unit.terms if "lora" not in t.ref.param], unit.size)
    assert first_order(m, base_only, x) > WRONG


@pytest.mark.parametrize("kind", ["litgpt", "loralib", "torchtune"])
def test_plain_torch_lora_layers(kind):
    layer = {"litgpt": LitLoRALinear, "loralib": LoralibLinear, "torchtune": TorchtuneLoRALinear}[kind]
    m = randomize(nn.Sequential(layer(6, 10), nn.ReLU(), layer(10, 4)))
    d = detect(m)
    fam = d.families()
    assert fam["deep_linear"] == 2 and fam.get("relu") == 1, (fam, reasons(d))
    assert d.undetected == []
    all_hold(m, d.laws, x_mlp())
    for p in [p for n, p in m.named_parameters() if "lora" not in n]:
        p.requires_grad_(False)
    d = detect(m)
    assert d.families() == {"deep_linear": 2}


def test_embedding_and_conv_adapters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = PeftEmbedding(nn.Embedding(11, 6), r=2, alpha=4)
            self.conv = PeftConv2d(nn.Conv2d(1, 4, 3), r=2, alpha=2)
            self.head = nn.Linear(6 + 4, 3)

        def forward(self, ids):
            e = self.emb(ids).mean(1)
            img = self.conv(e.reshape(-1, 1, 2, 3).repeat(1, 1, 3, 2)).mean((2, 3))
            return self.head(torch.cat([e, img], -1))

    m = randomize(Net())
    for n, p in m.named_parameters():
        p.requires_grad_("lora" in n)
    ids = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(0))
    d = detect(m, example_inputs=(ids,))
    assert sorted(law.name for law in d.laws) == ["conv/lora.default", "emb/lora.default"]
    conv = next(law for law in d.laws if law.name == "conv/lora.default")
    assert conv.size == 2 and len(conv.terms) == 3 + 1  # A: 3 kernel rows (one per position row), B: 1x1
    m.eval()
    for law in d.laws:
        assert first_order(m, law, ids) < TOL, law.name


def test_peft_wrapped_hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=17, hidden_size=16, intermediate_size=12, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    m = randomize(PeftModel(inject(hf, ("q_proj", "v_proj"), adapters={"default": (4, 8)})))
    d = detect(m)
    assert d.families() == {"deep_linear": 2}, (d.families(), reasons(d))
    assert sorted(law.name for law in d.laws) == ["base_model.model.model.layers.0.self_attn.q_proj/lora.default",
                                                  "base_model.model.model.layers.0.self_attn.v_proj/lora.default"]
    assert d.undetected == []
    assert any("frozen" in r for r in reasons(d).values())
    m.eval()
    ids = torch.randint(0, 17, (2, 5), generator=torch.Generator().manual_seed(0))

    class Logits(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids, use_cache=False).logits

    wrapped = Logits(m)
    for law in d.laws:
        law = law.__class__(law.name, law.layer, [t.__class__(t.kind, t.ref.__class__(
            "inner." + t.ref.param, *[getattr(t.ref, f) for f in ("start", "row_dim", "rows", "col_dim", "cols",
                                                                 "row_step")]), t.sign, t.offset, t.stride, t.shift)
            for t in law.terms], law.size)
        assert first_order(wrapped, law, ids) < TOL, law.name


def test_adapters_are_tracked_through_their_optimizer():
    """``conserve.track`` over the adapters' parameters only (base frozen): each step moves every adapter law by
    exactly ``lr^2 g^T M g`` (the first-order term vanishes: spec drift identity), and the tracker's values are
    the laws' values."""
    m = randomize(PeftModel(inject(mlp(), ("0", "2", "4"), adapters={"default": (3, 6)}, dropout=0.2)))
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    assert len(params) == 6
    lr = 1e-3
    opt = conserve.track(torch.optim.SGD(params, lr=lr), m, fp64=True, snapshot_budget=None, drift_every=1)
    tr = opt.tracker
    assert sorted(law.name for law in tr.laws) == [f"base_model.model.{i}/lora.default" for i in (0, 2, 4)]
    x, y = x_mlp(8), torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    drift = {law.name: 0.0 for law in tr.laws}
    start_plus = evaluate_laws([DeepLinearGram(law.name, law.layer, [t for t in law.terms if t.sign > 0], law.size)
                                for law in tr.laws], {n: p.detach().clone() for n, p in m.named_parameters()}, fp64=True)
    for _ in range(4):
        before = {k: v.clone() for k, v in tr.values().items()}
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        step = {n: (lr * p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()}
        opt.step()
        pred = evaluate_laws(tr.laws, step, fp64=True)
        now = tr.values()
        exact = evaluate_laws(tr.laws, {n: p.detach() for n, p in m.named_parameters()}, fp64=True)
        for law in tr.laws:
            torch.testing.assert_close(now[law.name].double(), exact[law.name], rtol=1e-9, atol=1e-12)
            change = now[law.name].double() - before[law.name].double()
            torch.testing.assert_close(change, pred[law.name], rtol=1e-6, atol=1e-10 * float(exact[law.name].abs().max()))
            drift[law.name] += float(change.norm())
    # the change of each law is the second-order term alone (asserted above) while A A^T moves to first order
    plus = [DeepLinearGram(law.name, law.layer, [t for t in law.terms if t.sign > 0], law.size) for law in tr.laws]
    end = evaluate_laws(plus, {n: p.detach() for n, p in m.named_parameters()}, fp64=True)
    for law in tr.laws:
        assert drift[law.name] < 0.1 * float((end[law.name] - start_plus[law.name]).norm()), law.name
