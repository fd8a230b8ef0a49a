"""Routing replay's record (`algo.routing_replay=replay`): the experts each token of an MoE
model was routed to while it was generated, for the trainer to route it the same way.

A generator's pass and the trainer's recompute of the same tokens can choose different
experts (other kernels, precision, batch shapes), and the importance ratio is then taken
between two different networks; replaying the generator's choice removes that (the "rollout
routing replay" of verl, slime and AReaL). The record is [rows, prompt width + response
length, MoE layers, k] expert indices in a Rollout's joined layout (left-padded prompt, then
the response), int16, -1 where no token was routed (padding, the last response token, which
no pass feeds, and a tool's output inserted into a response).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rlloom.models.moe import Routes, routing


def route_shape(model: nn.Module) -> tuple[int, int]:
    """(MoE layers, experts per token) of `model`'s config."""
    cfg = model.config
    return sum(map(cfg.is_moe_layer, range(cfg.num_layers))), cfg.experts_per_token


class RouteLog:
    """The routes of `rows` sequences of up to `width` joined positions, filled pass by pass
    from what `routes` recorded."""

    def __init__(self, model: nn.Module, routes: Routes, rows: int, width: int,
                 device: torch.device) -> None:
        self.routes, (self.layers, self.k) = routes, route_shape(model)
        self.log = torch.full((rows, width, self.layers, self.k), -1, dtype=torch.int16,
                              device=device)

    def taken(self) -> torch.Tensor:
        """The last pass's routes [tokens, layers, k], forgotten by the record."""
        rec = torch.stack([self.routes.recorded[j] for j in range(self.layers)], 1)
        self.routes.recorded.clear()
        return rec.to(torch.int16)


def pad_routes(routes: torch.Tensor, prompt: int, response: int, old_prompt: int) -> torch.Tensor:
    """`routes` [rows, old_prompt + t, ...] re-laid for a prompt width `prompt` and a response
    length `response` (cut or padded with -1 on either side)."""
    left = prompt - old_prompt
    routes = routes[:, max(-left, 0):] if left < 0 else torch.nn.functional.pad(
        routes, (0, 0, 0, 0, left, 0), value=-1)
    right = prompt + response - routes.shape[1]
    return routes[:, :prompt + response] if right <= 0 else torch.nn.functional.pad(
        routes, (0, 0, 0, 0, 0, right), value=-1)


class Agreement:
    """The share of replayed tokens whose own top k, as the trainer computes it, equals the
    experts they were generated with (`routing_agreement`; 1.0 when nothing differs)."""

    def __init__(self) -> None:
        self.matched = self.counted = 0

    @contextmanager
    def of(self, model: nn.Module, recorded: torch.Tensor | None) -> Iterator[None]:
        """`model`'s passes replay the `recorded` routes (a Rollout's; None: its own)."""
        if recorded is None:
            yield
            return
        with routing(model, recorded) as routes:
            yield
        self.matched += routes.matched
        self.counted += routes.counted

    def value(self) -> float:
        return float(self.matched / self.counted) if self.counted else float("nan")
