import os

# CI has no GPU: the Triton kernels run under the interpreter on CPU tensors.  Must be set before any
# triton.jit function of conserve.kernels is defined (they are imported lazily by the dispatch).
os.environ.setdefault("TRITON_INTERPRET", "1")

# The test models are tiny: one intra-op thread is as fast and does not contend with other processes
# (the distributed tests' ranks, or other jobs on a 2-core CI machine).
import torch  # noqa: E402

torch.set_num_threads(1)

# A torchvision built for another torch (e.g. the CUDA wheel beside a CPU torch) fails at import with
# RuntimeError ("operator torchvision::nms does not exist"), which transformers and timm do not catch.
# Make it look absent (ImportError): transformers then works without it; timm, which needs it, is skipped.
import sys  # noqa: E402

try:
    import torchvision  # noqa: F401,E402
except RuntimeError:
    for _k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[_k]
    sys.modules["torchvision"] = None
