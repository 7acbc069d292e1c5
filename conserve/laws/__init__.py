"""The law catalogue (spec ``../shared/spec/laws.md``) and its compilation into kernel plans."""
from .base import Compiled, Declined, Law, Ref, Term, cols, compile_laws, rows, vector
from .catalogue import (FAMILIES, DeepLinearGram, GainBalance, HeadGram, QKGram, ReLUPowerUnit, ReLUUnit, RopePairs,
                        RopePassGram, RouterSum, ScaleLaw, NormScaleLaw, SwiGLUUnit, Translation, UnitBalance, VOGram,
                        QKNormGain, LayerScaleBalance)
from .evaluate import evaluate_laws
from . import tolerance  # noqa: F401  (the tolerances of the numerical checks: conserve.laws.tolerance)

__all__ = ["Law", "Ref", "Term", "Declined", "Compiled", "rows", "cols", "vector", "compile_laws", "evaluate_laws",
           "FAMILIES", "UnitBalance", "SwiGLUUnit", "ReLUUnit", "ReLUPowerUnit", "HeadGram", "QKGram", "VOGram",
           "RopePassGram", "DeepLinearGram", "RopePairs", "RouterSum", "Translation", "GainBalance", "ScaleLaw", "NormScaleLaw",
           "QKNormGain", "LayerScaleBalance"]
