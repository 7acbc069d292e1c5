import os

# CI has no GPU: the Triton kernels run under the interpreter on CPU tensors.  Must be set before any
# triton.jit function of conserve.kernels is defined (they are imported lazily by the dispatch).
os.environ.setdefault("TRITON_INTERPRET", "1")

# The test models are tiny: one intra-op thread is as fast and does not contend with other processes
# (the distributed tests' ranks, or other jobs on a 2-core CI machine).
import torch  # noqa: E402

torch.set_num_threads(1)
