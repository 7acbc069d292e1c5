"""The one cache policy of the structures the kernels prepare once and reuse: ``KeyedCache``.

It holds the torch twin's grouped structures (``reference``), the Triton path's prepared plans
(``runner``) and the optimizer step's launch layouts (``step_runner``, in a store the optimizer
keeps).  A structure depends only on what its key holds (a plan's identity and sizes; dtypes,
shapes, strides, devices; the requests), never on tensor values or addresses, so a cached one gives
the very bits a rebuilt one would.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

__all__ = ["KeyedCache"]

_MISSING = object()


class KeyedCache:
    """At most ``limit`` entries; the least recently used is evicted first.

    The keys of an owner (a ``Plan``) start with ``id(owner)``: ``put(..., owner=plan)`` registers,
    once per owner, a finalizer that forgets its entries when it is garbage-collected (ids are
    reused); ``forget(id(owner))`` forgets them now.  ``store``: the mapping that holds the entries
    (default: a new one), e.g. a dict an optimizer keeps across steps.  A re-entrant lock guards the
    store (a garbage-collected owner's finalizer may run while it is held); dropped values are
    released outside it (one may own a plan whose finalizer takes it)."""

    def __init__(self, limit: int, store: dict | None = None):
        self.limit = int(limit)
        self.store = OrderedDict() if store is None else store
        self._lock = threading.RLock()
        self._owners: set = set()

    def get(self, key, default=None):
        """The value of ``key``, now the most recently used, or ``default``."""
        with self._lock:
            value = self.store.pop(key, _MISSING)
            if value is _MISSING:
                return default
            self.store[key] = value
            return value

    def put(self, key, value, owner=None) -> None:
        """``key -> value`` as the most recently used, evicting the least recently used beyond ``limit``."""
        with self._lock:
            dropped = [self.store.pop(key, None)]
            self.store[key] = value
            dropped += [self.store.pop(next(iter(self.store))) for _ in range(len(self.store) - self.limit)]
            new = owner is not None and id(owner) not in self._owners
            if new:
                self._owners.add(id(owner))
        del dropped
        if new:
            weakref.finalize(owner, self.forget, id(owner))

    def cached(self, key, build, owner=None):
        """The value of ``key``; on a miss ``build()``, stored (``put``) and returned."""
        value = self.get(key, _MISSING)
        if value is _MISSING:
            value = build()
            self.put(key, value, owner)
        return value

    def forget(self, owner_id: int) -> None:
        """Drop the entries whose key starts with ``owner_id``."""
        with self._lock:
            self._owners.discard(owner_id)
            dropped = [self.store.pop(k) for k in [k for k in self.store if k[0] == owner_id]]
        del dropped

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            dropped = list(self.store.values())
            self.store.clear()
        del dropped

    # read access (snapshots taken under the lock)
    def __len__(self) -> int:
        return len(self.store)

    def __contains__(self, key) -> bool:
        return key in self.store

    def __iter__(self):
        return iter(self.keys())

    def keys(self) -> list:
        with self._lock:
            return list(self.store)

    def values(self) -> list:
        with self._lock:
            return list(self.store.values())

    def items(self) -> list:
        with self._lock:
            return list(self.store.items())
