"""The op vocabulary of structural detection: how a traced graph's ops are named and grouped.

``Graph.op`` names every node by its op (an fx target, an ATen overload packet, a method, a module type) and
``ALIAS`` folds the spellings of one op into one name; the sets below say what the block finders may walk
through. Only data: nothing here imports from the detection package.
"""
from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # casts to these are made float64 in the probe's graph
ALIAS = {"_softmax": "softmax", "bmm": "matmul", "mm": "matmul", "scaled_dot_product_attention": "sdpa",
         "truediv": "div", "relu_": "relu", "mul_": "mul", "add_": "add", "leaky_relu_": "leaky_relu",
         "gelu_": "gelu", "silu_": "silu", "native_dropout": "dropout", "dropout_": "dropout",
         "_to_copy": "to", "type_as": "to", "type": "to", "float": "to", "double": "to", "half": "to", "bfloat16": "to",
         "_unsafe_view": "view", "masked_fill_": "masked_fill", "__getitem__": "getitem", "rms_norm": "rms_norm"}
# positively homogeneous element-wise maps: f(c z) = c f(z) for c > 0 (the unit law's rescaling passes)
POSITIVE = {"relu", "leaky_relu"}
# element-wise activations with no continuous rescaling symmetry (spec: GELU / SiLU FFN row)
NO_LAW = {"gelu", "silu", "tanh", "sigmoid", "elu", "selu", "celu", "mish", "softplus", "hardswish", "hardsigmoid",
          "hardtanh", "relu6", "softsign", "glu", "logsigmoid", "erf"}
# ops that move or copy features without mixing them (a reader behind them still reads the same feature)
PASS = {"dropout", "to", "contiguous", "clone", "view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze",
        "getitem", "index_select", "index", "expand", "mean", "sum", "alias", "identity", "repeat",
        "repeat_interleave", "cat", "stack", "permute", "transpose", "split", "chunk", "split_with_sizes",
        "narrow", "slice", "select", "t", "movedim", "type", "lift_fresh_copy", "dropout1d", "dropout2d"}
# ops between the scores matmul and softmax that keep the scores recognised (cat: extra logits beside the scores,
# GPT-OSS attention sinks)
SCORE_OPS = {"mul", "div", "add", "sub", "masked_fill", "to", "tanh", "where", "dropout", "float", "permute",
             "transpose", "contiguous", "view", "reshape", "cat"}
# ops between the probabilities and the ``@ V`` matmul (a slice: the probabilities of the real keys, GPT-OSS sinks)
PROB_OPS = {"dropout", "to", "contiguous", "clone", "alias", "identity", "permute", "transpose", "view", "reshape",
            "getitem", "slice", "narrow"}
ELEMENTWISE = POSITIVE | NO_LAW | {"pow", "square", "abs", "exp", "sin", "cos", "sqrt", "log", "neg", "sign", "clamp",
                                    "clamp_min", "where"}
# single-input ops a value keeps its features through (dropout, casts)
CASTS = {"dropout", "to", "contiguous", "clone", "alias", "identity"}
# ``x.shape`` / ``x.dtype`` / ...: reads no value of x
TENSOR_METADATA = {"shape", "dtype", "device", "ndim", "layout", "is_cuda", "requires_grad", "is_sparse", "is_meta"}
SHAPE_ONLY = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "size", "dim",
              "sym_size", "_assert_tensor_metadata"}
