"""conserve: track the conservation laws of training dynamics (spec: ``shared/spec/laws.md``).

The path: model -> laws (``model.conservation_laws()`` or ``conserve.detect``) -> kernels
(``conserve.kernels``) -> tracker (``conserve.track`` / ``Tracker``) -> sinks.
"""
from .laws import Declined, Law, compile_laws, evaluate_laws
from .optim import TrackedOptimizer, track
from .sinks import JSONLSink, MemorySink, TensorBoardSink, WandbSink
from .tracker import Tracker
from .verify import verify
from .detection import detect
from .counting import count_laws as count
from .analysis.discover import discover

__version__ = "0.1.0"

__all__ = ["track", "Tracker", "TrackedOptimizer", "Law", "Declined", "compile_laws", "evaluate_laws", "verify",
           "JSONLSink", "MemorySink", "TensorBoardSink", "WandbSink", "detect", "count", "discover"]

