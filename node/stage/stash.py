"""Weight stashing: a saved autograd graph keeps the weights it was built with.

Asynchronous pipelines step the optimizer while other microbatches are still in flight
(SWARM, arXiv 2301.11913, section 3), and a saved graph is only valid for the weights it was
built with. PipeDream's answer (arXiv 1806.03377, section 3.3) is to stash them: the
forward's graph refers to parameters through ``saved_tensors_hooks`` that remember the
weights' *epoch*, and before any change to the weights (an optimizer or outer step, adopted
weights) that a live graph still refers to, their storage is copied once. A backward then
uses its own forward's weights, as the stages downstream did, and costs no recomputation.

Owns the epochs, the hooks and the copies. Does not own which graphs are alive (the runner
says, by the epochs of its saved microbatches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _ParamRef:
    """A saved tensor that lives in a parameter's storage, as the forward's graph keeps it."""

    tensor: torch.Tensor
    storage: int
    view: tuple[int, tuple[int, ...], tuple[int, ...]]
    """Offset, size and stride in that storage, as at the forward (``.data`` may be swapped)."""
    epoch: int


class WeightStash:
    """The weights' epoch and the copies of older epochs that saved graphs still use."""

    def __init__(self) -> None:
        self.epoch = 0
        """Bumped at every change of the weights."""
        self._copies: dict[int, dict[int, torch.UntypedStorage]] = {}
        """Per epoch still used by a saved graph: copies of the parameter storages."""
        self._param_storages: set[int] = set()

    @property
    def num_stashed(self) -> int:
        """Older epochs whose copies are kept (saved graphs still refer to them)."""
        return len(self._copies)

    def hooks(self, module: torch.nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
        """The context a training forward runs under, so its graph can find its weights."""
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def change(self, module: torch.nn.Module, live_epochs: Callable[[], set[int]]) -> None:
        """Call before changing ``module``'s weights: copy them if a saved graph still
        refers to them (``live_epochs()``: the epochs of the graphs still saved)."""
        if self.epoch in live_epochs():
            copies: dict[int, torch.UntypedStorage] = {}
            for p in module.parameters():  # after an outer step they share one storage
                ptr = p.untyped_storage().data_ptr()
                if ptr not in copies:
                    copies[ptr] = p.detach().untyped_storage().clone()
            self._copies[self.epoch] = copies
        self.epoch += 1

    def drop_unused(self, live_epochs: Callable[[], set[int]]) -> None:
        """Free the copies no saved graph refers to any more."""
        if self._copies:
            live = live_epochs()
            for epoch in [e for e in self._copies if e not in live]:
                del self._copies[epoch]

    def _pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor hook: remember which weights' epoch a parameter (or a view) came from."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._param_storages:
            view = (int(t.storage_offset()), tuple(t.size()), tuple(t.stride()))
            return _ParamRef(t, ptr, view, self.epoch)
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        """The saved tensor as it was at the forward: from the copies if the weights changed."""
        if not isinstance(packed, _ParamRef):
            return packed
        t = packed.tensor
        if packed.epoch == self.epoch:
            return t
        storage = self._copies[packed.epoch][packed.storage]
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, *packed.view)
