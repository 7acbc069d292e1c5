import os

# CI has no GPU: the Triton kernels run under the interpreter on CPU tensors.  Must be set before any
# triton.jit function of conserve.kernels is defined (they are imported lazily by the dispatch).
os.environ.setdefault("TRITON_INTERPRET", "1")
