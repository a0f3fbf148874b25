"""Models with named cut points, one factory per family (torchvision style).

Every model is a :class:`StagedModel`: an ordered ``nn.ModuleDict`` of named
*stages* executed one after the other. The model may be cut after any stage but
the last (``model.cut_points``); :func:`split_layer.cut.split_model` turns
``(model, cut)`` into a bottom and a top that share the model's parameters, so
``top(bottom(x))`` is bit-identical to ``model(x)``.

The last stage is always called ``"head"``; it is an ``nn.Sequential`` whose
final module is the output ``nn.Linear``, exposed as ``model.classifier`` (used
for weight diversity on the classifier and for FedPer's local head).
``model.classifier_prefix`` is its ``state_dict`` prefix.

Families
--------
:data:`MODELS` is the one list of model families (the run config's ``model`` key takes its
names); each family's cut points and default cut are tabulated from the built models in
docs/config.md (``python -m flower_apps.config``). ``vgg11-small`` is ``vgg11`` at a quarter
of the widths.

* ``cnn`` - Semi-SFL's SVHN CNN (its Sec. V-A): conv5x5(32) -> ReLU ->
  maxpool2 -> conv5x5(64) -> ReLU -> maxpool2 -> FC512 -> ReLU -> FC(M). The
  convolutions are **unpadded** ("valid"): for 3x32x32 input this gives a 64x5x5
  feature map and 878,538 parameters = 3,514,152 bytes in float32 = **3.35 MiB**,
  the paper's model size (with "same" padding it would be 8.4 MB). That figure is
  for ``norm="none"``; ``"bn"``/``"gn"`` add 192 affine parameters. 1x28x28 input
  gives a 64x4x4 map (582,026 parameters with 10 classes).
* ``cnn-afo`` - the EMNIST CNN of "Adaptive Federated Optimization" (Reddi et al.), the
  model SSFL's authors train on EMNIST (the SSFL paper's Sec. 4): conv3x3(32) -> ReLU ->
  conv3x3(64) -> ReLU -> maxpool2 -> Dropout2d(dropout / 2) -> FC128 -> ReLU ->
  Dropout(dropout) -> FC(M), valid convolutions (1,199,882 parameters at 1x28x28, 10
  classes). With ``dropout=0.5`` the two dropouts are the authors' 0.25 / 0.5. The authors'
  module defines a GroupNorm that its ``forward`` never calls: ``norm="none"`` is their net.
* ``mlp`` - Flatten -> ``hidden`` Linear layers (default one of 500; Fed-SHVR's
  paper net is ``hidden=(5000,)``) each followed by norm, ReLU and dropout -> FC(M).
  ``norm`` applies to the hidden layers (BatchNorm1d / GroupNorm / none); use
  ``norm="none"`` for the plain Fed-SHVR MLP.
* ``alexnet`` - SCALA's CIFAR AlexNet (named in its Sec. 5.1; the layers are our choice): client side
  conv3x3(32)+pool, conv3x3(64)+pool (64x8x8 activation at 32x32), server side
  conv3x3(128), conv3x3(256), conv3x3(256)+pool (256x4x4), FC512, FC256, FC(M);
  3.21 M parameters for 10 classes. (Semi-SFL's CIFAR "AlexNet" with 7x7/11x11
  kernels is under-specified; this one is used for both, split after conv5 for
  Semi-SFL.)
* ``vgg16`` - the usual CIFAR VGG-16: 13 conv3x3 layers (64,64,M,128,128,M,
  256x3,M,512x3,M,512x3,M), global average pool, FC512, FC512, FC(M).
* ``resnet18`` - CIFAR ResNet-18: 3x3 stem conv(64) without max-pool, four
  stages of two BasicBlocks (64, 128, 256, 512), global average pool, FC(M).
* ``resnet9`` - DAWNBench ResNet-9 (UM-pFSSL's Sec. 6.1): prep conv(64);
  layer1 = conv(128)+pool+residual(128, 128); layer2 = conv(256)+pool;
  layer3 = conv(512)+pool+residual(512, 512); global max pool; FC(M). The
  DAWNBench logit scale (x0.125) and bias-free FC are not reproduced.
* ``cnn13`` - the Temporal-Ensembling / Mean-Teacher CNN-13 (Fed-SHVR's Sec. V names
  CNN-13; the layers are that standard net): 3 x conv3x3(128) + pool + dropout, 3 x conv3x3(256) + pool +
  dropout, conv3x3(512, valid), conv1x1(256), conv1x1(128), each with norm and
  LeakyReLU(0.1), global average pool, FC(M). (No weight normalisation.)

* ``vgg11`` - VGG-11 (configuration "A": 64, M, 128, M, 256, 256, M, 512, 512, M,
  512, 512, M) with the **bottleneck** of SCALA-PE / ResSFL (SCALA Sec. 5.7;
  ResSFL's ``vgg11_bn`` with ``cutlayer=4``, ``bottleneck_option="norelu_C8S1"``):
  conv1 = conv3x3(64)+norm+ReLU+pool, conv2 = conv3x3(128)+norm+ReLU+pool, then the
  client's stage ``bottleneck`` = conv3x3(128 -> 8), stride 1, no norm, no ReLU
  (the cut: 8 x H/4 x W/4, 8x7x7 at 28x28); the server's first layer expands back,
  conv3x3(8 -> 128), stride 1, no ReLU, at the start of ``conv3`` = that conv +
  conv3x3(256)+norm+ReLU; conv4..conv8 as configuration A (pools after conv4, conv6,
  conv8, dropped on a 1x1 map as in ``vgg16``), global average pool, FC512, FC512,
  FC(M) (the library's FC layout, as ``vgg16``; ResSFL's classifier is the same with
  dropout before each hidden FC). Cutting at ``conv2`` instead keeps the bottleneck
  pair on the server. ``bottleneck=0`` (a keyword of :func:`vgg11`, not a run-config
  key) builds the plain VGG-11 without the pair (cut points conv1 .. conv8, fc1,
  fc2; default conv2).
* ``vgg11-small`` - ``vgg11`` with every width divided by 4 (16, 32, 64, 64, 128,
  128, 128, 128; FC 128) and the same 8-channel bottleneck [ours]: the CPU-sized
  member of the family for 28x28 MNIST-5k (about 1/16 of the FLOPs).

Where the architectures adapt to the input
------------------------------------------
* ``in_channels`` / ``num_classes`` set the first conv (or first Linear) and the
  output Linear.
* Flattening models (``cnn``, ``alexnet``) compute the flattened size from
  ``image_size``. To keep large inputs sane, the feature map is adaptively
  average-pooled to at most 5x5 (``cnn``) / 4x4 (``alexnet``) before flattening;
  at 32x32 this pooling is absent, so the paper sizes are exact.
* ``vgg16`` omits a max-pool when the map is already 1x1 (at 28x28 the maps are
  28, 14, 7, 3, 1 and the fifth pool is dropped) and ends with global average
  pooling. ``resnet18``/``resnet9``/``cnn13`` end with global pooling, so any
  ``image_size`` that survives their downsampling works.
* Too small an ``image_size`` raises ``ValueError`` naming ``image_size``.

Normalisation and dropout
-------------------------
``norm="bn"`` -> BatchNorm, ``"gn"`` -> GroupNorm with 32 groups (or the largest
divisor of the channel count <= 32), ``"none"`` -> Identity. Conv layers followed
by a norm layer keep their bias (harmless, keeps ``"none"`` a real conv net).

``dropout`` (default 0, i.e. no Dropout modules at all) is placed:

* ``cnn``, ``mlp``, ``alexnet``, ``vgg16``: after every hidden FC activation
  (i.e. before each following FC layer, including the output one);
* ``resnet18``: before the output FC (it has no hidden FC);
* ``resnet9``: after the last two norm layers (the ReLUs of the 512 residual
  block), as UM-pFSSL says; it has no hidden FC, so nothing else;
* ``cnn13``: after each of the two max-pools (the paper net uses 0.5).

Dropout draws from the torch RNG of the device, so the same seed reproduces the
same mask (split learning re-runs a forward pass bit-identically).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "MODELS",
    "NORMS",
    "StagedModel",
    "check_cut",
    "as_staged",
    "build_model",
    "classifier_prefix",
    "head_prefix",
    "has_dropout",
    "cnn",
    "cnn_afo",
    "mlp",
    "alexnet",
    "vgg16",
    "resnet18",
    "resnet9",
    "cnn13",
    "vgg11",
    "vgg11_small",
    "make_norm",
]

NORMS = ("bn", "gn", "none")


def check_cut(cut: str | None, stage_names: Sequence[str], what: str, hint: str = "",
              error: type[Exception] = ValueError) -> str:
    """The one check of a cut point: ``cut`` must name a stage other than the last (the head),
    i.e. one of ``StagedModel.cut_points``; returns it. Otherwise ``error(f"{what}; allowed:
    <cut points>{hint}")`` (``what`` names the key and the model)."""
    points = list(stage_names)[:-1]
    if not cut or cut not in points:
        raise error(f"{what}; allowed: {', '.join(points)}{hint}")
    return cut


# ---------------------------------------------------------------------------
# The staged model
# ---------------------------------------------------------------------------
class StagedModel(nn.Module):
    """An ordered sequence of named stages; cut after any stage but the last.

    Attributes:
        name: model family (``"cnn"``, ``"resnet18"``, ...).
        stages: ``nn.ModuleDict`` of stage name -> module, executed in order.
            The last stage is ``"head"``, an ``nn.Sequential`` ending with the
            output ``nn.Linear``.
        default_cut: the cut point the papers use.
        config: the keyword arguments the model was built with (for rebuilding).
    """

    def __init__(
        self,
        name: str,
        stages: "OrderedDict[str, nn.Module] | Iterable[tuple[str, nn.Module]]",
        default_cut: str,
        config: dict | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.stages = nn.ModuleDict(OrderedDict(stages))
        names = list(self.stages.keys())
        if len(names) < 2:
            raise ValueError("a StagedModel needs at least two stages")
        if not any(isinstance(m, nn.Linear) for m in self.stages[names[-1]].modules()):
            raise ValueError("the last stage (the head) must contain the output nn.Linear")
        self.default_cut = check_cut(default_cut, names, f"default_cut={default_cut!r} is not a cut point")
        self.config = dict(config or {})

    # -- structure ---------------------------------------------------------
    @property
    def stage_names(self) -> list[str]:
        return list(self.stages.keys())

    @property
    def cut_points(self) -> list[str]:
        """Names after which the model may be cut (every stage but the last)."""
        return self.stage_names[:-1]

    @property
    def head(self) -> nn.Sequential:
        """The last stage (pooling/flatten/dropout as needed, then the classifier)."""
        return self.stages[self.stage_names[-1]]  # type: ignore[return-value]

    @property
    def classifier(self) -> nn.Linear:
        """The output (last) linear layer."""
        return [m for m in self.head.modules() if isinstance(m, nn.Linear)][-1]

    @property
    def classifier_prefix(self) -> str:
        """``state_dict`` prefix of :attr:`classifier`, e.g. ``"stages.head.1."``."""
        return classifier_prefix(self)

    @property
    def feature_dim(self) -> int:
        """Width of the representation fed to :attr:`classifier`."""
        return self.classifier.in_features

    @property
    def num_classes(self) -> int:
        return self.classifier.out_features

    # -- forward -----------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages.values():
            x = stage(x)
        return x

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The ``[B, feature_dim]`` input of :attr:`classifier`."""
        stages = list(self.stages.values())
        for stage in stages[:-1]:
            x = stage(x)
        for module in list(self.head)[:-1]:
            x = module(x)
        return x

    def extra_repr(self) -> str:
        return f"name={self.name!r}, cut_points={self.cut_points}, default_cut={self.default_cut!r}"


# ---------------------------------------------------------------------------
# Any model: a user's own
# ---------------------------------------------------------------------------
def classifier_prefix(model: nn.Module) -> str:
    """``state_dict`` prefix of the model's last ``nn.Linear`` (its classifier), e.g. ``"fc2."``."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to serve as its classifier")
    return names[-1] + "." if names[-1] else ""


def head_prefix(model: nn.Module) -> str:
    """``state_dict`` prefix of the model's head: a StagedModel's last stage, else its classifier
    (FedPer keeps it local)."""
    if isinstance(model, StagedModel):
        return f"stages.{model.stage_names[-1]}."
    return classifier_prefix(model)


def has_dropout(model: nn.Module) -> bool:
    """Whether the model has a dropout layer with p > 0 (MC-dropout needs one)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def as_staged(model, cut: str | None = None) -> StagedModel:
    """A user's model as a :class:`StagedModel`, which split learning cuts.

    * a ``StagedModel``: as it is (``cut`` picks one of its cut points);
    * a pair ``(bottom, top)``: the stages ``"bottom"`` and ``"top"``, cut between them
      (``state_dict`` keys ``stages.bottom.<key>`` and ``stages.top.<key>``);
    * an ``nn.Sequential``: each child is a stage (keys ``stages.<i>.<key>``), cut after the
      child named ``cut`` (required).

    The modules are shared, not copied. The last stage must contain the output ``nn.Linear``.
    """
    if isinstance(model, StagedModel):
        return model
    if isinstance(model, (tuple, list)) and len(model) == 2 and all(isinstance(m, nn.Module) for m in model):
        return StagedModel("custom", [("bottom", model[0]), ("top", model[1])], default_cut="bottom")
    if isinstance(model, nn.Sequential):
        names = [n for n, _ in model.named_children()]
        check_cut(cut, names, f"cut={cut!r}: an nn.Sequential is cut after one of its children")
        return StagedModel("sequential", list(model.named_children()), default_cut=cut)
    raise ValueError(f"a split algorithm needs a StagedModel, a (bottom, top) pair or an nn.Sequential with "
                     f"a cut; got {type(model).__name__}")


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------
def _gn_groups(channels: int, max_groups: int = 32) -> int:
    for g in range(min(max_groups, channels), 0, -1):
        if channels % g == 0:
            return g
    return 1


def make_norm(norm: str, channels: int, *, dim: int = 2) -> nn.Module:
    """BatchNorm (``dim``=1 or 2), GroupNorm(32 or largest divisor), or Identity."""
    _check_norm(norm)
    if norm == "bn":
        return nn.BatchNorm2d(channels) if dim == 2 else nn.BatchNorm1d(channels)
    if norm == "gn":
        return nn.GroupNorm(_gn_groups(channels), channels)
    return nn.Identity()


def _dropout(p: float) -> list[nn.Module]:
    return [nn.Dropout(p)] if p > 0 else []


def _conv_block(cin: int, cout: int, norm: str, *, kernel: int = 3, padding: int = 1,
                act: Callable[[], nn.Module] = lambda: nn.ReLU(inplace=True)) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, padding=padding), make_norm(norm, cout), act()]


def _fc_block(fin: int, fout: int, dropout: float) -> list[nn.Module]:
    return [nn.Linear(fin, fout), nn.ReLU(inplace=True), *_dropout(dropout)]


def _check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r} is not one of {', '.join(NORMS)}")


def _check_common(in_channels: int, num_classes: int, image_size: int, norm: str, dropout: float) -> None:
    for key, value in (("in_channels", in_channels), ("num_classes", num_classes), ("image_size", image_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be a positive integer")
    if num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r} must be at least 2")
    _check_norm(norm)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r} must be in [0, 1)")


def _need(name: str, image_size: int, ok: bool, minimum: int) -> None:
    if not ok:
        raise ValueError(f"image_size={image_size} is too small for model {name!r} (minimum {minimum})")


def _pool_at_most(side: int, cap: int) -> tuple[list[nn.Module], int]:
    """An adaptive average pool to ``cap`` x ``cap`` where a flattening model's map is larger
    (large inputs), else nothing; returns the modules and the side after them."""
    return ([nn.AdaptiveAvgPool2d(cap)], cap) if side > cap else ([], side)


def _config(**kw) -> dict:
    return dict(kw)


# ---------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------
def cnn(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
        dropout: float = 0.0) -> StagedModel:
    """Semi-SFL's small CNN (valid 5x5 convs; 3.35 MiB at 3x32x32, norm="none")."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    s = (image_size - 4) // 2
    s = (s - 4) // 2
    _need("cnn", image_size, s >= 1, 16)
    pool, s = _pool_at_most(s, 5)
    stages = [
        ("conv1", nn.Sequential(*_conv_block(in_channels, 32, norm, kernel=5, padding=0), nn.MaxPool2d(2))),
        ("conv2", nn.Sequential(*_conv_block(32, 64, norm, kernel=5, padding=0), nn.MaxPool2d(2))),
        ("fc1", nn.Sequential(*pool, nn.Flatten(), *_fc_block(64 * s * s, 512, dropout))),
        ("head", nn.Sequential(nn.Linear(512, num_classes))),
    ]
    return StagedModel("cnn", stages, "conv2", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout))


def cnn_afo(*, in_channels: int, num_classes: int, image_size: int, norm: str = "none",
            dropout: float = 0.5) -> StagedModel:
    """The EMNIST CNN of "Adaptive Federated Optimization" that SSFL's authors train (their Sec. 4):
    conv3x3(32)+ReLU, conv3x3(64)+ReLU, maxpool2, Dropout2d(dropout / 2), FC128+ReLU,
    Dropout(dropout), FC(M); valid convolutions. ``norm`` after each conv ('none' is the
    authors' forward pass, which defines GroupNorm but never calls it)."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    s = (image_size - 4) // 2
    _need("cnn-afo", image_size, s >= 1, 6)
    pool, s = _pool_at_most(s, 12)
    stages = [
        ("conv1", nn.Sequential(*_conv_block(in_channels, 32, norm, kernel=3, padding=0))),
        ("conv2", nn.Sequential(*_conv_block(32, 64, norm, kernel=3, padding=0), nn.MaxPool2d(2),
                                *([nn.Dropout2d(dropout / 2)] if dropout > 0 else []))),
        ("fc1", nn.Sequential(*pool, nn.Flatten(), *_fc_block(64 * s * s, 128, dropout))),
        ("head", nn.Sequential(nn.Linear(128, num_classes))),
    ]
    return StagedModel("cnn-afo", stages, "conv2", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout))


def mlp(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
        dropout: float = 0.0, hidden: Sequence[int] = (500,)) -> StagedModel:
    """Flatten -> hidden Linear+norm+ReLU(+dropout) layers -> Linear(num_classes)."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    hidden = tuple(hidden)
    if not hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden):
        raise ValueError(f"hidden={hidden!r} must be a non-empty sequence of positive integers")
    stages: list[tuple[str, nn.Module]] = []
    fin = in_channels * image_size * image_size
    for i, h in enumerate(hidden, start=1):
        layers: list[nn.Module] = [nn.Flatten()] if i == 1 else []
        layers += [nn.Linear(fin, h), make_norm(norm, h, dim=1), nn.ReLU(inplace=True), *_dropout(dropout)]
        stages.append((f"fc{i}", nn.Sequential(*layers)))
        fin = h
    stages.append(("head", nn.Sequential(nn.Linear(fin, num_classes))))
    return StagedModel("mlp", stages, "fc1", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm,
        dropout=dropout, hidden=list(hidden)))


def alexnet(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
            dropout: float = 0.0) -> StagedModel:
    """SCALA's CIFAR AlexNet (5 conv3x3 layers, FC512, FC256, FC(M))."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    s = image_size // 2 // 2 // 2
    _need("alexnet", image_size, s >= 1, 8)
    pool, s = _pool_at_most(s, 4)
    stages = [
        ("conv1", nn.Sequential(*_conv_block(in_channels, 32, norm), nn.MaxPool2d(2))),
        ("conv2", nn.Sequential(*_conv_block(32, 64, norm), nn.MaxPool2d(2))),
        ("conv3", nn.Sequential(*_conv_block(64, 128, norm))),
        ("conv4", nn.Sequential(*_conv_block(128, 256, norm))),
        ("conv5", nn.Sequential(*_conv_block(256, 256, norm), nn.MaxPool2d(2))),
        ("fc1", nn.Sequential(*pool, nn.Flatten(), *_fc_block(256 * s * s, 512, dropout))),
        ("fc2", nn.Sequential(*_fc_block(512, 256, dropout))),
        ("head", nn.Sequential(nn.Linear(256, num_classes))),
    ]
    return StagedModel("alexnet", stages, "conv2", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout))


def alexnet_semisfl(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
                    dropout: float = 0.0) -> StagedModel:
    """Semi-SFL's CIFAR-10 AlexNet, reconstructed from the paper's words: five conv layers (one
    11x11, one 7x7, three 3x3), two FC hidden layers and an output layer; "an 8-layer AlexNet
    with the size of 137 MB: split at the 5th layer, its bottom model and features are about 9 MB
    and 1 MB" (Sec. III, features of a batch of 64). [ours] torchvision's AlexNet widths (64,
    192, 384, 256, 256) and FC 4096-4096, a 4x4 map after conv5 (pools after conv1, conv2 and
    conv5, then an adaptive pool to 4x4): at 3x32x32 the model is 145 MB, the bottom 11 MB and
    the features of 64 samples 1.0 MiB. Default cut: conv5 (the paper's split layer 5)."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    _need("alexnet-semisfl", image_size, image_size >= 8, 8)
    stages = [
        ("conv1", nn.Sequential(*_conv_block(in_channels, 64, norm, kernel=11, padding=5), nn.MaxPool2d(2))),
        ("conv2", nn.Sequential(*_conv_block(64, 192, norm, kernel=7, padding=3), nn.MaxPool2d(2))),
        ("conv3", nn.Sequential(*_conv_block(192, 384, norm))),
        ("conv4", nn.Sequential(*_conv_block(384, 256, norm))),
        ("conv5", nn.Sequential(*_conv_block(256, 256, norm), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(4))),
        ("fc1", nn.Sequential(nn.Flatten(), *_fc_block(256 * 4 * 4, 4096, dropout))),
        ("fc2", nn.Sequential(*_fc_block(4096, 4096, dropout))),
        ("head", nn.Sequential(nn.Linear(4096, num_classes))),
    ]
    return StagedModel("alexnet-semisfl", stages, "conv5", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout))


_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
          dropout: float = 0.0) -> StagedModel:
    """CIFAR VGG-16: 13 conv3x3 (+norm+ReLU), global avg pool, FC512, FC512, FC(M)."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    stages: list[tuple[str, nn.Module]] = []
    cin, s, i = in_channels, image_size, 0
    for v in _VGG16:
        if v == "M":
            if s >= 2:  # never pool a 1x1 map (small inputs, e.g. 28x28)
                stages[-1][1].append(nn.MaxPool2d(2))
                s //= 2
            continue
        i += 1
        stages.append((f"conv{i}", nn.Sequential(*_conv_block(cin, v, norm))))
        cin = v
    stages.append(("fc1", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), *_fc_block(512, 512, dropout))))
    stages.append(("fc2", nn.Sequential(*_fc_block(512, 512, dropout))))
    stages.append(("head", nn.Sequential(nn.Linear(512, num_classes))))
    return StagedModel("vgg16", stages, "conv13", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout))


_VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def vgg11(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
          dropout: float = 0.0, width_divisor: int = 1, bottleneck: int = 8,
          name: str = "vgg11") -> StagedModel:
    """VGG-11 (configuration A) with SCALA-PE's / ResSFL's bottleneck after conv2: the client
    compresses to ``bottleneck`` channels (conv3x3, stride 1, no ReLU), the server's first conv
    expands back; ``width_divisor`` divides every other width; ``bottleneck=0``: no pair."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    _need(name, image_size, image_size >= 4, 4)
    for key, value, lo in (("width_divisor", width_divisor, 1), ("bottleneck", bottleneck, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{key}={value!r} must be an integer >= {lo}")
    stages: list[tuple[str, nn.Module]] = []
    cin, s, i = in_channels, image_size, 0
    expand: list[nn.Module] = []
    for v in _VGG11:
        if v == "M":
            if s >= 2:  # never pool a 1x1 map (small inputs, e.g. 28x28)
                stages[-1][1].append(nn.MaxPool2d(2))
                s //= 2
            if i == 2 and bottleneck:  # after conv2 (and its pool): the bottleneck pair
                stages.append(("bottleneck", nn.Sequential(nn.Conv2d(cin, bottleneck, 3, padding=1))))
                expand = [nn.Conv2d(bottleneck, cin, 3, padding=1)]
            continue
        i += 1
        cout = max(1, v // width_divisor)
        stages.append((f"conv{i}", nn.Sequential(*expand, *_conv_block(cin, cout, norm))))
        expand, cin = [], cout
    fc = max(1, 512 // width_divisor)
    stages.append(("fc1", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), *_fc_block(cin, fc, dropout))))
    stages.append(("fc2", nn.Sequential(*_fc_block(fc, fc, dropout))))
    stages.append(("head", nn.Sequential(nn.Linear(fc, num_classes))))
    return StagedModel(name, stages, "bottleneck" if bottleneck else "conv2", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout,
        width_divisor=width_divisor, bottleneck=bottleneck))


def vgg11_small(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
                dropout: float = 0.0, bottleneck: int = 8) -> StagedModel:
    """``vgg11`` with widths divided by 4 (the 8-channel bottleneck kept): the CPU-sized member."""
    return vgg11(in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm,
                 dropout=dropout, width_divisor=4, bottleneck=bottleneck, name="vgg11-small")


class BasicBlock(nn.Module):
    """ResNet basic block: two conv3x3 with norm, identity or 1x1-conv shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = make_norm(norm, cout)
        self.relu = nn.ReLU(inplace=True)
        if stride != 1 or cin != cout:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), make_norm(norm, cout))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def resnet18(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
             dropout: float = 0.0) -> StagedModel:
    """CIFAR ResNet-18 (3x3 stem, no max-pool), global avg pool, FC(M)."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    _need("resnet18", image_size, image_size >= 8, 8)
    stages: list[tuple[str, nn.Module]] = [
        ("stem", nn.Sequential(nn.Conv2d(in_channels, 64, 3, padding=1, bias=False),
                               make_norm(norm, 64), nn.ReLU(inplace=True))),
    ]
    cin = 64
    for i, (cout, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2)), start=1):
        stages.append((f"layer{i}", nn.Sequential(BasicBlock(cin, cout, stride, norm),
                                                  BasicBlock(cout, cout, 1, norm))))
        cin = cout
    stages.append(("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), *_dropout(dropout),
                                         nn.Linear(512, num_classes))))
    return StagedModel("resnet18", stages, "layer1", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout))


class Residual(nn.Module):
    """``x + f(x)`` (DAWNBench residual; ``f`` is two conv-norm-ReLU blocks)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def resnet9(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
            dropout: float = 0.0) -> StagedModel:
    """DAWNBench ResNet-9; dropout after the last two norm layers (UM-pFSSL)."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    _need("resnet9", image_size, image_size >= 8, 8)

    def cbr(cin: int, cout: int, *extra: nn.Module) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), make_norm(norm, cout), nn.ReLU(inplace=True), *extra]

    stages = [
        ("prep", nn.Sequential(*cbr(in_channels, 64))),
        ("layer1", nn.Sequential(*cbr(64, 128), nn.MaxPool2d(2),
                                 Residual(nn.Sequential(*cbr(128, 128), *cbr(128, 128))))),
        ("layer2", nn.Sequential(*cbr(128, 256), nn.MaxPool2d(2))),
        ("layer3", nn.Sequential(*cbr(256, 512), nn.MaxPool2d(2),
                                 Residual(nn.Sequential(*cbr(512, 512, *_dropout(dropout)),
                                                        *cbr(512, 512, *_dropout(dropout)))))),
        ("head", nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))),
    ]
    return StagedModel("resnet9", stages, "layer1", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout))


def cnn13(*, in_channels: int, num_classes: int, image_size: int, norm: str = "bn",
          dropout: float = 0.0) -> StagedModel:
    """Mean-Teacher CNN-13 with LeakyReLU(0.1); dropout after the two max-pools."""
    _check_common(in_channels, num_classes, image_size, norm, dropout)
    _need("cnn13", image_size, image_size // 2 // 2 >= 3, 12)

    def lrelu() -> nn.Module:
        return nn.LeakyReLU(0.1, inplace=True)

    def block(cin: int, cout: int, kernel: int = 3, padding: int = 1, *extra: nn.Module) -> nn.Sequential:
        return nn.Sequential(*_conv_block(cin, cout, norm, kernel=kernel, padding=padding, act=lrelu), *extra)

    stages = [
        ("conv1", block(in_channels, 128)),
        ("conv2", block(128, 128)),
        ("conv3", block(128, 128, 3, 1, nn.MaxPool2d(2), *_dropout(dropout))),
        ("conv4", block(128, 256)),
        ("conv5", block(256, 256)),
        ("conv6", block(256, 256, 3, 1, nn.MaxPool2d(2), *_dropout(dropout))),
        ("conv7", block(256, 512, 3, 0)),
        ("conv8", block(512, 256, 1, 0)),
        ("conv9", block(256, 128, 1, 0)),
        ("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes))),
    ]
    return StagedModel("cnn13", stages, "conv3", _config(
        in_channels=in_channels, num_classes=num_classes, image_size=image_size, norm=norm, dropout=dropout))


MODELS: dict[str, Callable[..., StagedModel]] = {
    "cnn": cnn,
    "cnn-afo": cnn_afo,
    "mlp": mlp,
    "alexnet": alexnet,
    "alexnet-semisfl": alexnet_semisfl,
    "vgg16": vgg16,
    "resnet18": resnet18,
    "resnet9": resnet9,
    "cnn13": cnn13,
    "vgg11": vgg11,
    "vgg11-small": vgg11_small,
}


def build_model(name: str, *, in_channels: int, num_classes: int, image_size: int,
                norm: str = "bn", dropout: float = 0.0, **options) -> StagedModel:
    """Build model family ``name`` (a key of :data:`MODELS`).

    ``options`` are family-specific extras (only ``mlp`` has one: ``hidden``).
    Raises ``ValueError`` naming the offending key for an unknown model, norm,
    a dropout outside [0, 1) or an image too small for the architecture.
    """
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not one of {', '.join(MODELS)}")
    return MODELS[name](in_channels=in_channels, num_classes=num_classes, image_size=image_size,
                        norm=norm, dropout=dropout, **options)
