"""Name -> function registries: a new estimator or loss is a new function, not a new `if`.

A registration may declare what the function needs from the run beyond the rollout itself;
`rlloom.algos.contracts.algo_problems` checks those needs before a run starts, so a
combination that cannot run fails at once instead of after the first generation.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)

# need -> what it is: the named requirements a registration may declare
NEEDS: dict[str, str] = {
    "critic": "per-token critic values V(s_t) of the sampled responses",
    "greedy_baseline": "the reward of one greedy response to each prompt",
    "prox_logp": "log-probs of the sampled tokens under the proximal policy (the weights "
                 "before this step's update)",
}


class Registry(Generic[F]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}
        self._needs: dict[str, frozenset[str]] = {}

    def register(self, name: str, needs: Iterable[str] = ()) -> Callable[[F], F]:
        """Register the decorated function as `name`; `needs` are keys of `NEEDS`."""
        needs = frozenset(needs)
        unknown = needs - NEEDS.keys()
        if unknown:
            raise ValueError(f"{self.kind} {name!r} declares unknown needs {sorted(unknown)}; "
                             f"known needs: {', '.join(NEEDS)}")

        def add(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            self._needs[name] = needs
            return fn
        return add

    def get(self, name: str) -> F:
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self._items[name]

    def needs(self, name: str) -> frozenset[str]:
        """What `name` declared it needs (empty when nothing beyond the rollout)."""
        self.get(name)  # the same error for an unknown name
        return self._needs[name]

    def names(self) -> list[str]:
        return sorted(self._items)
