"""LoRA-like adapters on one base model: random low-rank perturbations, one active per forward pass.

Adapter ``a`` adds ``delta_a(x) = (x A_a^T) B_a^T`` to the output of every targeted projection
(``A_a``: ``[rank, in]``, ``B_a``: ``[out, rank]``, drawn from a seeded generator). The effect is scaled so
that ``delta_a(x)`` has about ``strength`` times the standard deviation of the projection's own output
on random inputs. Targets default to the key and value projections (``k_proj``, ``v_proj``; GPT-2's fused
``c_attn``), so an adapter changes the K/V of every layer: a block computed under adapter ``a`` is
wrong under ``b`` (why the adapter id is part of every block key). Implemented with forward hooks: the
base weights are untouched and :meth:`AdapterSet.remove` restores the plain model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch

from kvlab.errors import ConfigError

DEFAULT_TARGETS = ("k_proj", "v_proj", "c_attn")


def _in_out(module: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of an ``nn.Linear`` or a GPT-2 ``Conv1D`` (weight ``[in, out]``)."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if weight is not None and weight.dim() == 2 and hasattr(module, "nf"):
        return int(weight.shape[0]), int(weight.shape[1])
    raise ConfigError(f"cannot attach an adapter to {type(module).__name__} (needs nn.Linear or Conv1D)")


class AdapterSet:
    """Named random low-rank adapters hooked into ``model``; ``active`` selects one (None = base model).

    Invariant: outside :meth:`use` the active adapter is None, so a forward pass sees the base model
    unless a request names its adapter.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        names: Sequence[str] = ("lora-a", "lora-b"),
        *,
        rank: int = 4,
        strength: float = 0.5,
        targets: Sequence[str] = DEFAULT_TARGETS,
        seed: int = 0,
    ) -> None:
        if not names or len(set(map(str, names))) != len(names):
            raise ConfigError(f"adapter names must be distinct and non-empty, got {list(names)}")
        if rank < 1 or strength <= 0:
            raise ConfigError(f"adapters need rank >= 1 and strength > 0, got {rank}, {strength}")
        self.names = tuple(str(n) for n in names)
        self.rank, self.strength, self.seed = int(rank), float(strength), int(seed)
        self.targets = tuple(targets)
        self.active: str | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._deltas: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in self.names}
        gen = torch.Generator().manual_seed(self.seed)
        modules = [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in self.targets]
        if not modules:
            raise ConfigError(f"no module of {type(model).__name__} is named one of {self.targets}")
        for _, module in modules:
            n_in, n_out = _in_out(module)
            weight = module.weight
            out_std = float(weight.detach().float().std()) * math.sqrt(n_in)  # std of W x for unit-variance x
            index = len(self._deltas[self.names[0]])
            for name in self.names:
                a = torch.randn(self.rank, n_in, generator=gen) / math.sqrt(n_in)
                b = torch.randn(n_out, self.rank, generator=gen) * (self.strength * out_std / math.sqrt(self.rank))
                self._deltas[name].append(
                    (a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype))
                )
            self._hooks.append(module.register_forward_hook(self._hook(index)))
        self.num_modules = len(modules)

    def _hook(self, index: int) -> Callable[[torch.nn.Module, tuple, torch.Tensor], torch.Tensor | None]:
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if self.active is None:
                return None
            a, b = self._deltas[self.active][index]
            return output + (args[0] @ a.T) @ b.T

        return hook

    def check(self, name: object) -> str | None:
        """``name`` as an adapter id (None, NaN and NA mean the base model); ConfigError if unknown."""
        if name is None or (isinstance(name, float) and math.isnan(name)) or type(name).__name__ == "NAType":
            return None
        if str(name) not in self.names:
            raise ConfigError(f"unknown adapter {name!r}; this AdapterSet has {list(self.names)}")
        return str(name)

    @contextlib.contextmanager
    def use(self, name: object) -> Iterator[None]:
        """Run the enclosed forward passes with adapter ``name`` (None: the base model)."""
        previous, self.active = self.active, self.check(name)
        try:
            yield
        finally:
            self.active = previous

    def remove(self) -> None:
        """Detach every hook: the model is the plain base model again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.active = None

    def config(self) -> dict:
        return {"names": list(self.names), "rank": self.rank, "strength": self.strength,
                "targets": list(self.targets), "seed": self.seed, "modules": self.num_modules}
