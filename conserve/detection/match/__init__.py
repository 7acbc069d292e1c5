"""The block finders of structural detection, each reading a traced ``Graph`` into candidate laws (``Found``).

``FINDERS`` runs in this order: multi-head latent attention (the sites it takes are skipped by the
next), attention (its q/k/v/o projections are then used), routers (a linear read
only by softmax), MLPs, convolution channels and the gains of per-channel norms, gains (their readers include every
linear found so far), output layers.
"""
from __future__ import annotations

from .attention import attention, mha_modules
from .conv import channel_gains, channel_layer_scales, channels
from .gain import gains
from .mla import mla
from .mlp import mlps
from .output import output_layers
from .router import routers

FINDERS = (mla, attention, mha_modules, routers, mlps, channels, channel_gains, channel_layer_scales, gains, output_layers)

__all__ = ["FINDERS", "attention", "mha_modules", "channel_gains", "channel_layer_scales", "channels", "gains", "mla", "mlps", "output_layers", "routers"]
