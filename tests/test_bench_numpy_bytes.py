"""bench.track_overhead.numpy_bytes: host arrays counted once; an array viewing a torch storage the
LiveBytes counter already saw (``t.numpy()`` of a CPU tensor) is not counted again."""

import numpy as np
import torch

from bench.track_overhead import LiveBytes, numpy_bytes


def test_numpy_view_of_a_counted_storage_is_not_counted_twice():
    own = np.zeros(100, dtype=np.int32)  # 400 B of host memory of its own
    with LiveBytes() as m:
        t = torch.zeros(50, dtype=torch.float32)  # 200 B, counted by LiveBytes
    v = t.numpy()
    holder = {"own": own, "view": v, "slice": v[10:20], "again": own[3:7]}
    assert numpy_bytes(holder) == 400 + 200  # without the storages: the view counted as numpy too
    assert numpy_bytes(holder, storages=m.live) == 400
    assert m.cur == 200
    other = torch.zeros(30)  # a storage LiveBytes did not see: its view is numpy-only memory here
    assert numpy_bytes({"x": other.numpy()}, storages=m.live) == 120
