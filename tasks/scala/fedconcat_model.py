"""FedConcat's concatenated model, for any model whose output is its last ``nn.Linear``'s
(:mod:`strategies.scala.fedconcat`; Diao, Li, He, AAAI 2024).

A model ``f(x) = W e(x) + b`` is split generically: the *head* is its last ``nn.Linear`` (in
``named_modules`` order, as :func:`tasks.models.classifier_prefix` finds it), the *encoder*
``e`` is the same model with that layer replaced by ``nn.Identity`` (so its ``state_dict`` is
the model's minus the head's ``weight``/``bias``). :func:`check_split` verifies on a batch that
``f(x) == head(e(x))`` and that ``e(x)`` is ``[B, d]``, and raises a ``ConfigError`` otherwise
(a model that does something after its last linear layer, or applies it to a sequence).

:class:`ConcatModel` is ``x -> W' [e_1(x); ...; e_K(x)] + b'`` with K frozen encoders (kept in
eval mode, no gradient) and a trainable head ``nn.Linear(K d, M)``. :func:`concat_heads`
builds FedConcat's head initialisation ``W' = [W_1 ... W_K]``, ``b' = sum_k b_k``, for which
``W' phi(x) + b' = sum_k (W_k e_k(x) + b_k)``: the concatenated model's logits are the sum of
the K cluster models' logits.
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import torch
from torch import nn

from tasks.config import ConfigError

__all__ = ["head_name", "head_keys", "strip_head", "check_split", "ConcatModel", "concat_heads"]


def head_name(model: nn.Module) -> str:
    """Module name of the model's head: its last ``nn.Linear`` (``ConfigError`` if it has none,
    or if the model is that layer itself)."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ConfigError(f"algo=fedconcat needs a model whose last nn.Linear is its classifier (the head); "
                          f"{type(model).__name__} has no nn.Linear layer")
    if names[-1] == "":
        raise ConfigError("algo=fedconcat needs an encoder before the head: the model is a single nn.Linear")
    return names[-1]


def head_keys(model: nn.Module) -> list[str]:
    """``state_dict`` keys of the head (``<name>.weight`` and, if it has one, ``<name>.bias``)."""
    prefix = head_name(model) + "."
    return [k for k in model.state_dict() if k.startswith(prefix)]


def strip_head(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """``(encoder, head)``: ``model`` itself with its head replaced by ``nn.Identity`` (in place),
    and the removed ``nn.Linear``."""
    name = head_name(model)
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    head = model.get_submodule(name)
    setattr(parent, child, nn.Identity())
    return model, head


@torch.no_grad()
def check_split(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Check on the batch ``x`` that ``model(x) == head(encoder(x))`` with ``encoder(x)`` of
    shape ``[B, d]``; returns ``(d, M)``. Raises ``ConfigError`` naming what is wrong."""
    name = head_name(model)
    was = model.training
    model.eval()
    try:
        out = model(x)
        encoder, head = strip_head(copy.deepcopy(model))
        feats = encoder(x)
    finally:
        model.train(was)
    if feats.dim() != 2:
        raise ConfigError(f"algo=fedconcat: the input of the head '{name}' (the model's last nn.Linear) has shape "
                          f"{list(feats.shape)}; it must be a [batch, features] matrix")
    if out.shape != (x.shape[0], head.out_features) or not torch.allclose(head(feats), out, rtol=1e-4, atol=1e-5):
        raise ConfigError(f"algo=fedconcat: the model's output is not its last nn.Linear '{name}' applied to that "
                          f"layer's input; FedConcat concatenates the features before the head, so the head "
                          f"must be the model's last operation")
    return head.in_features, head.out_features


class ConcatModel(nn.Module):
    """``x -> head([e_1(x); ...; e_K(x)])`` with frozen encoders (module docstring).

    The encoders stay in eval mode (BatchNorm statistics fixed, no dropout) and get no
    gradient; ``train()`` switches only the head. ``state_dict`` keys: ``encoders.<k>.<key>``
    and ``head.weight``/``head.bias``."""

    def __init__(self, encoders: Sequence[nn.Module], head: nn.Linear) -> None:
        super().__init__()
        self.encoders = nn.ModuleList(encoders)
        self.head = head
        for p in self.encoders.parameters():
            p.requires_grad_(False)
        self.encoders.eval()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``phi(x) = [e_1(x); ...; e_K(x)]``, ``[B, K d]``."""
        with torch.no_grad():
            return torch.cat([e(x) for e in self.encoders], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def train(self, mode: bool = True) -> "ConcatModel":
        super().train(mode)
        self.encoders.eval()
        return self


def concat_heads(heads: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """FedConcat's head initialisation from the K cluster heads (``{"weight": [M, d], "bias":
    [M]}`` each): ``weight = [W_1 ... W_K]`` (``[M, K d]``) and ``bias = sum_k b_k`` (no bias if
    the heads have none)."""
    if not heads:
        raise ValueError("need at least one head")
    out = {"weight": np.concatenate([np.asarray(h["weight"]) for h in heads], axis=1)}
    if "bias" in heads[0]:
        out["bias"] = np.sum([np.asarray(h["bias"], dtype=np.float64) for h in heads], axis=0).astype(
            np.asarray(heads[0]["bias"]).dtype)
    return out
