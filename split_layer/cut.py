"""Cut a :class:`tasks.models.StagedModel` into a bottom and a top part (pure torch).

``split_model(model, cut)`` returns two :class:`ModelPart` modules that hold the
*same* stage modules as ``model`` (no copies): ``top(bottom(x))`` runs exactly the
operations of ``model(x)`` (bit-identical output, same RNG draws for dropout,
BatchNorm statistics updated once), and an optimiser step on either part updates
``model``.

A part's ``state_dict`` keys are the model's own keys (``"stages.conv1.0.weight"``,
...), so a client can receive only the bottom weights::

    keys = bottom_state_keys(model, "conv2")
    payload = bottom_state(model, "conv2")            # {key: tensor} for those keys
    load_bottom_state(other_model, payload, "conv2")  # strict: exactly those keys
    bottom.load_state_dict(payload)                   # also works on the part itself

``cut_cost(model, cut, input_shape, batch, iterations)`` counts what a node of a split round
moves and computes at that cut (activation, gradient, label and bottom bytes; FLOPs of the
bottom and of the whole model by torch's counter): SCALA's Table V (``python -m flower_apps.cost``).

``cut=None`` or ``cut=""`` means ``model.default_cut`` (the run config uses ``""``
for "the paper's default").
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tasks.models import StagedModel, check_cut

__all__ = [
    "ModelPart",
    "resolve_cut",
    "feature_shape",
    "split_model",
    "bottom_stage_names",
    "top_stage_names",
    "bottom_state_keys",
    "top_state_keys",
    "bottom_state",
    "top_state",
    "load_bottom_state",
    "load_top_state",
]


class ModelPart(nn.Module):
    """A contiguous run of a StagedModel's stages, sharing its modules.

    Attributes:
        model_name: family of the model it was cut from.
        stages: ``nn.ModuleDict`` of the shared stage modules (same key layout as the
            model, so ``state_dict`` keys match the model's).
        has_head: whether this part ends with the model's head (the top part); then
            :attr:`classifier` and :meth:`forward_features` are available.
    """

    def __init__(self, model_name: str, stages: "OrderedDict[str, nn.Module]", has_head: bool) -> None:
        super().__init__()
        self.model_name = model_name
        self.stages = nn.ModuleDict(stages)
        self.has_head = has_head

    @property
    def stage_names(self) -> list[str]:
        return list(self.stages.keys())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages.values():
            x = stage(x)
        return x

    def _require_head(self) -> nn.Sequential:
        if not self.has_head:
            raise AttributeError("this part does not contain the model head (it is a bottom part)")
        return self.stages[self.stage_names[-1]]  # type: ignore[return-value]

    @property
    def classifier(self) -> nn.Linear:
        return self._require_head()[-1]  # type: ignore[return-value]

    @property
    def feature_dim(self) -> int:
        return self.classifier.in_features

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Run the part up to (excluding) the classifier: ``[B, feature_dim]``."""
        head = self._require_head()
        for stage in list(self.stages.values())[:-1]:
            x = stage(x)
        for module in list(head)[:-1]:
            x = module(x)
        return x

    def extra_repr(self) -> str:
        return f"model_name={self.model_name!r}, stages={self.stage_names}"


def resolve_cut(model: StagedModel, cut: str | None) -> str:
    """Return ``cut`` (or the model's default for ``None``/``""``) after validating it
    (:func:`tasks.models.check_cut`)."""
    if cut is None or cut == "":
        return model.default_cut
    return check_cut(cut, model.stage_names, f"cut={cut!r} is not a cut point of model {model.name!r}")


def feature_shape(bottom: nn.Module, input_shape: tuple[int, ...], device: torch.device | None = None
                  ) -> tuple[int, ...]:
    """The shape of the bottom's output (the features that cross the cut) for one input of
    ``input_shape`` (``(C, H, W)``), without the batch dimension. Measured in eval mode (no
    BatchNorm statistics updated, no dropout draw) and without a graph; the bottom's mode is
    restored. ``device``: where the probe input is made (default: where the bottom's first
    parameter or buffer lives, so a bottom already on a GPU is measured there)."""
    if device is None:
        first = next(iter(bottom.parameters()), None)
        if first is None:
            first = next(iter(bottom.buffers()), None)
        device = first.device if first is not None else None
    was = bottom.training
    bottom.eval()
    try:
        with torch.no_grad():
            return tuple(bottom(torch.zeros(1, *input_shape, device=device)).shape[1:])
    finally:
        bottom.train(was)


def _index(model: StagedModel, cut: str | None) -> int:
    return model.stage_names.index(resolve_cut(model, cut)) + 1


def bottom_stage_names(model: StagedModel, cut: str | None) -> list[str]:
    """Stage names up to and including ``cut``."""
    return model.stage_names[: _index(model, cut)]


def top_stage_names(model: StagedModel, cut: str | None) -> list[str]:
    """Stage names after ``cut`` (always ends with the head)."""
    return model.stage_names[_index(model, cut):]


def split_model(model: StagedModel, cut: str | None) -> tuple[ModelPart, ModelPart]:
    """Cut ``model`` after stage ``cut`` into ``(bottom, top)`` sharing its parameters."""
    if not isinstance(model, StagedModel):
        raise TypeError(f"model must be a StagedModel, got {type(model).__name__}")
    i = _index(model, cut)
    items = list(model.stages.items())
    bottom = ModelPart(model.name, OrderedDict(items[:i]), has_head=False)
    top = ModelPart(model.name, OrderedDict(items[i:]), has_head=True)
    # Parts inherit the model's train/eval mode.
    bottom.train(model.training)
    top.train(model.training)
    return bottom, top


def _keys_for(model: StagedModel, names: list[str]) -> list[str]:
    prefixes = tuple(f"stages.{n}." for n in names)
    return [k for k in model.state_dict().keys() if k.startswith(prefixes)]


def bottom_state_keys(model: StagedModel, cut: str | None) -> list[str]:
    """The model's ``state_dict`` keys (params and buffers) that belong to the bottom."""
    return _keys_for(model, bottom_stage_names(model, cut))


def top_state_keys(model: StagedModel, cut: str | None) -> list[str]:
    """The model's ``state_dict`` keys that belong to the top."""
    return _keys_for(model, top_stage_names(model, cut))


def _state(model: StagedModel, keys: list[str]) -> "OrderedDict[str, torch.Tensor]":
    sd = model.state_dict()
    return OrderedDict((k, sd[k]) for k in keys)


def bottom_state(model: StagedModel, cut: str | None) -> "OrderedDict[str, torch.Tensor]":
    """``{key: tensor}`` of the bottom part (tensors are the model's, detached; copy to keep)."""
    return _state(model, bottom_state_keys(model, cut))


def top_state(model: StagedModel, cut: str | None) -> "OrderedDict[str, torch.Tensor]":
    """``{key: tensor}`` of the top part."""
    return _state(model, top_state_keys(model, cut))


def _load(model: StagedModel, state: Mapping[str, torch.Tensor], keys: list[str], part: str, strict: bool) -> None:
    expected = set(keys)
    given = set(state.keys())
    unexpected = sorted(given - expected)
    if unexpected:
        raise ValueError(f"state keys not in the {part} of model {model.name!r}: {', '.join(unexpected[:5])}"
                         + (" ..." if len(unexpected) > 5 else ""))
    missing = sorted(expected - given)
    if strict and missing:
        raise ValueError(f"state is missing {part} keys of model {model.name!r}: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    model.load_state_dict(dict(state), strict=False)


def load_bottom_state(model: StagedModel, state: Mapping[str, torch.Tensor], cut: str | None,
                      *, strict: bool = True) -> None:
    """Copy a bottom ``state`` into ``model`` in place (top untouched).

    Keys outside the bottom always raise ``ValueError``; with ``strict`` every bottom
    key must be present.
    """
    _load(model, state, bottom_state_keys(model, cut), "bottom", strict)


def load_top_state(model: StagedModel, state: Mapping[str, torch.Tensor], cut: str | None,
                   *, strict: bool = True) -> None:
    """Copy a top ``state`` into ``model`` in place (bottom untouched)."""
    _load(model, state, top_state_keys(model, cut), "top", strict)


def cut_cost(model: torch.nn.Module, cut: Any, input_shape: tuple[int, ...], batch: int,
               iterations: int, label_bytes: int = 8) -> dict[str, float]:
    """What one node of a split round moves and computes, counted from the model itself: per
    iteration, the activations it uploads (``batch`` samples of the cut's output, float32), the
    labels and the gradients it downloads; per round, the bottom's weights down and up (BatchNorm
    buffers included) over ``iterations`` iterations; the bottom's and the full model's FLOPs per
    iteration, forward only and forward + backward (torch's FLOP counter,
    :func:`tasks.system.module_flops`). Bytes as :func:`strategies.core.byte_meter.array_bytes` counts
    them (elements x item size)."""
    from tasks.system import module_flops

    bottom, _ = split_model(model, cut)
    x = torch.randn(batch, *input_shape)
    bf, act = module_flops(bottom, x)
    bt, _ = module_flops(bottom, x, train=True)
    ff, _ = module_flops(model, x)
    ft, _ = module_flops(model, x, train=True)
    act_bytes = act.numel() * 4
    w_c = sum(v.numel() * v.element_size() for v in bottom.state_dict().values())
    w = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    return {"activation-bytes": float(act_bytes), "gradient-bytes": float(act_bytes),
            "label-bytes": float(batch * label_bytes), "bottom-bytes": float(w_c), "model-bytes": float(w),
            "bottom-forward-flops": bf, "bottom-train-flops": bt, "model-forward-flops": ff,
            "model-train-flops": ft, "iterations": float(iterations), "batch": float(batch)}
