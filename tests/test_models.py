"""Models with named cut points and split_layer.cut: exact split, shared params, errors."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from split_layer.cut import (
    ModelPart,
    bottom_state,
    bottom_state_keys,
    load_bottom_state,
    load_top_state,
    resolve_cut,
    split_model,
    top_state,
    top_state_keys,
)
from tasks.models import MODELS, NORMS, StagedModel, build_model, make_norm

SHAPES = [(1, 28), (3, 32)]
EXPECTED_CUTS = {
    "cnn": (["conv1", "conv2", "fc1"], "conv2"),
    "cnn-afo": (["conv1", "conv2", "fc1"], "conv2"),
    "mlp": (["fc1"], "fc1"),
    "alexnet": (["conv1", "conv2", "conv3", "conv4", "conv5", "fc1", "fc2"], "conv2"),
    "alexnet-semisfl": (["conv1", "conv2", "conv3", "conv4", "conv5", "fc1", "fc2"], "conv5"),
    "vgg16": ([f"conv{i}" for i in range(1, 14)] + ["fc1", "fc2"], "conv13"),
    "resnet18": (["stem", "layer1", "layer2", "layer3", "layer4"], "layer1"),
    "resnet9": (["prep", "layer1", "layer2", "layer3"], "layer1"),
    "cnn13": ([f"conv{i}" for i in range(1, 10)], "conv3"),
    "vgg11": (["conv1", "conv2", "bottleneck"] + [f"conv{i}" for i in range(3, 9)] + ["fc1", "fc2"], "bottleneck"),
    "vgg11-small": (["conv1", "conv2", "bottleneck"] + [f"conv{i}" for i in range(3, 9)] + ["fc1", "fc2"],
                    "bottleneck"),
}


def _build(name, c, s, **kw):
    torch.manual_seed(0)
    return build_model(name, in_channels=c, num_classes=10, image_size=s, **kw)


def _x(c, s, b=2):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, c, s, s, generator=g)


def test_registry_and_cut_points():
    assert set(MODELS) == set(EXPECTED_CUTS)
    assert NORMS == ("bn", "gn", "none")
    for name, (cuts, default) in EXPECTED_CUTS.items():
        m = _build(name, 3, 32)
        assert isinstance(m, StagedModel)
        assert m.cut_points == cuts, name
        assert m.default_cut == default, name
        assert m.stage_names[-1] == "head"
        assert isinstance(m.classifier, nn.Linear) and m.classifier.out_features == 10
        assert m.feature_dim == m.classifier.in_features
        prefix = m.classifier_prefix
        assert {k for k in m.state_dict() if k.startswith(prefix)} == {prefix + "weight", prefix + "bias"}


def test_cnn_afo_is_the_ssfl_authors_emnist_net():
    # Reddi et al.'s EMNIST CNN: conv3x3(32), conv3x3(64), pool, Dropout2d(0.25), FC128, Dropout(0.5), FC.
    m = _build("cnn-afo", 1, 28, norm="none", dropout=0.5)
    assert sum(p.numel() for p in m.parameters()) == (9 * 32 + 32) + (9 * 32 * 64 + 64) + (9216 * 128 + 128) + (128 * 10 + 10)
    drops = [(type(d).__name__, d.p) for d in m.modules() if isinstance(d, torch.nn.modules.dropout._DropoutNd)]
    assert drops == [("Dropout2d", 0.25), ("Dropout", 0.5)]
    assert not any(isinstance(x, (torch.nn.GroupNorm, torch.nn.BatchNorm2d)) for x in m.modules())
    assert not any(isinstance(d, torch.nn.Dropout2d) for d in _build("cnn-afo", 1, 28, norm="gn").modules())


def test_cnn_parameter_count_matches_semisfl_size():
    # Semi-SFL reports 3.35 MB for its SVHN CNN; valid 5x5 convs give exactly that (MiB).
    m = _build("cnn", 3, 32, norm="none")
    n = sum(p.numel() for p in m.parameters())
    print(f"cnn 3x32x32 parameters: {n} = {n * 4 / 2**20:.2f} MiB (float32)")
    assert n == 878_538
    assert round(n * 4 / 2**20, 2) == 3.35
    assert sum(p.numel() for p in _build("cnn", 1, 28, norm="none").parameters()) == 582_026
    # SCALA's AlexNet: ~19k client-side parameters (conv1+conv2), ~3.2M in total.
    a = _build("alexnet", 3, 32, norm="none")
    bottom, _ = split_model(a, "conv2")
    assert sum(p.numel() for p in bottom.parameters()) == 896 + 18_496
    assert sum(p.numel() for p in a.parameters()) == 3_210_058


def test_semisfl_alexnet_has_the_papers_sizes():
    # "an 8-layer AlexNet with the size of 137 MB ... its bottom model and features are about 9 MB
    # and 1 MB" (features of a batch of 64); ours: 145 MB, an 11 MB bottom, 1.0 MiB of features
    from split_layer.cut import cut_cost

    m = _build("alexnet-semisfl", 3, 32, norm="none")
    c = cut_cost(m, "conv5", (3, 32, 32), 64, 1)
    assert c["activation-bytes"] == 64 * 256 * 4 * 4 * 4 == 2 ** 20
    assert 130e6 < c["model-bytes"] < 150e6 and 8e6 < c["bottom-bytes"] < 12e6
    assert _build("alexnet-semisfl", 1, 28).feature_dim == 4096


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("shape", SHAPES, ids=["1x28", "3x32"])
def test_split_is_exact_for_every_cut(name, shape):
    """Structurally at every cut (bottom + top are the model's stages, in order, sharing its
    very modules, and so its parameters and buffers), numerically at the default cut (the
    forward of a stage does not depend on where the model is cut, so one numeric check per
    model and input shape covers every cut)."""
    c, s = shape
    x = _x(c, s)
    m = _build(name, c, s, norm="bn").eval()
    stages = list(m.stages.values())
    for cut in m.cut_points:
        bottom, top = split_model(m, cut)
        flat = [mod for part in (bottom, top) for mod in part.stages.values()]
        assert len(flat) == len(stages) and all(a is b for a, b in zip(flat, stages)), (name, cut)
        assert {id(p) for p in bottom.parameters()} | {id(p) for p in top.parameters()} == \
            {id(p) for p in m.parameters()}
        assert not {id(p) for p in bottom.parameters()} & {id(p) for p in top.parameters()}
    # eval mode, BN
    with torch.no_grad():
        ref = m(x)
        bottom, top = split_model(m, m.default_cut)
        assert torch.equal(top(bottom(x)), ref), name
    assert ref.shape == (2, 10)

    # train mode, BN + dropout, same seed: same output and same BN running statistics
    # (a forward pass changes only buffers: BN running stats and batch counters)
    m = _build(name, c, s, norm="bn", dropout=0.3).train()
    buffers0 = {k: v.clone() for k, v in m.named_buffers()}
    torch.manual_seed(123)
    ref = m(x)
    buffers_ref = {k: v.clone() for k, v in m.named_buffers()}
    for cut in [m.default_cut]:
        with torch.no_grad():
            for k, v in m.named_buffers():
                v.copy_(buffers0[k])
        bottom, top = split_model(m, cut)
        assert bottom.training and top.training
        torch.manual_seed(123)
        out = top(bottom(x))
        assert torch.equal(out, ref), (name, cut)
        for k, v in m.named_buffers():
            assert torch.equal(v, buffers_ref[k]), (name, cut, k)


@pytest.mark.parametrize("name", list(MODELS))
def test_split_learning_gradients_match_unsplit(name):
    """Client/server exchange: detach at the cut, backprop the activation gradient."""
    c, s = (1, 28) if name in ("vgg16", "resnet18") else (3, 32)
    m = _build(name, c, s, norm="bn", dropout=0.2).train()
    x, y = _x(c, s), torch.tensor([1, 7])
    state0 = copy.deepcopy(m.state_dict())
    torch.manual_seed(5)
    nn.functional.cross_entropy(m(x), y).backward()
    ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    # every cut is checked for exact outputs above; here a spread of cuts keeps it fast
    cuts = m.cut_points if len(m.cut_points) <= 5 else sorted(
        set(m.cut_points[::4]) | {m.default_cut, m.cut_points[-1]}, key=m.cut_points.index)
    for cut in cuts:
        m.load_state_dict(state0)
        m.zero_grad(set_to_none=True)
        bottom, top = split_model(m, cut)
        torch.manual_seed(5)
        act = bottom(x)
        server_in = act.detach().requires_grad_(True)
        nn.functional.cross_entropy(top(server_in), y).backward()
        act.backward(server_in.grad)
        for n, p in m.named_parameters():
            assert p.grad is not None, (name, cut, n)
            assert torch.equal(p.grad, ref_grads[n]), (name, cut, n)
        assert any(p.grad.abs().sum() > 0 for p in bottom.parameters())
        assert any(p.grad.abs().sum() > 0 for p in top.parameters())


def test_parts_share_parameters_and_training_updates_model():
    m = _build("cnn", 3, 32)
    bottom, top = split_model(m, "conv2")
    assert isinstance(bottom, ModelPart) and isinstance(top, ModelPart)
    model_ptrs = {p.data_ptr() for p in m.parameters()}
    part_ptrs = [p.data_ptr() for p in list(bottom.parameters()) + list(top.parameters())]
    assert len(part_ptrs) == len(model_ptrs) and set(part_ptrs) == model_ptrs
    before = copy.deepcopy(m.state_dict())
    opt = torch.optim.SGD(bottom.parameters(), lr=0.1)
    top(bottom(_x(3, 32))).sum().backward()
    opt.step()
    after = m.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(k in bottom_state_keys(m, "conv2") for k in changed)
    # parts keep the model's key layout
    assert list(bottom.state_dict()) == bottom_state_keys(m, "conv2")
    assert list(top.state_dict()) == top_state_keys(m, "conv2")
    assert top.classifier is m.classifier and top.feature_dim == m.feature_dim
    with pytest.raises(AttributeError):
        bottom.classifier


def test_state_keys_partition_and_bottom_loading():
    m1, m2 = _build("alexnet", 3, 32), build_model("alexnet", in_channels=3, num_classes=10, image_size=32)
    cut = "conv3"
    bk, tk = bottom_state_keys(m1, cut), top_state_keys(m1, cut)
    assert set(bk).isdisjoint(tk) and sorted(bk + tk) == sorted(m1.state_dict())
    assert any("running_mean" in k for k in bk)  # buffers travel with the part
    top2_before = copy.deepcopy(top_state(m2, cut))
    load_bottom_state(m2, {k: v.clone() for k, v in bottom_state(m1, cut).items()}, cut)
    for k in bk:
        assert torch.equal(m2.state_dict()[k], m1.state_dict()[k])
    for k, v in top_state(m2, cut).items():
        assert torch.equal(v, top2_before[k])
    # the part itself accepts the payload too
    b2, _ = split_model(m2, cut)
    b2.load_state_dict(bottom_state(m1, cut))
    with pytest.raises(ValueError, match="not in the bottom"):
        load_bottom_state(m2, top_state(m1, cut), cut)
    partial = dict(list(bottom_state(m1, cut).items())[:2])
    with pytest.raises(ValueError, match="missing bottom keys"):
        load_bottom_state(m2, partial, cut)
    load_bottom_state(m2, partial, cut, strict=False)
    load_top_state(m2, top_state(m1, cut), cut)
    assert all(torch.equal(v, m1.state_dict()[k]) for k, v in m2.state_dict().items())


@pytest.mark.parametrize("name", list(MODELS))
def test_groupnorm_and_no_norm_variants(name):
    c, s = (1, 28)
    x = _x(c, s)
    for norm in ("gn", "none"):
        m = _build(name, c, s, norm=norm).eval()
        assert not any(isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)) for mod in m.modules())
        if norm == "gn":
            gns = [mod for mod in m.modules() if isinstance(mod, nn.GroupNorm)]
            assert gns and all(g.num_channels % g.num_groups == 0 for g in gns)
        with torch.no_grad():
            ref = m(x)
            bottom, top = split_model(m, m.default_cut)
            assert torch.equal(top(bottom(x)), ref)
        assert torch.isfinite(ref).all()


def test_norm_factory():
    assert isinstance(make_norm("bn", 64), nn.BatchNorm2d)
    assert isinstance(make_norm("bn", 64, dim=1), nn.BatchNorm1d)
    assert make_norm("gn", 64).num_groups == 32
    assert make_norm("gn", 500).num_groups == 25  # largest divisor of 500 <= 32
    assert make_norm("gn", 24).num_groups == 24
    assert isinstance(make_norm("none", 64), nn.Identity)


def test_dropout_placement_and_mc_dropout():
    assert not any(isinstance(mod, nn.Dropout) for mod in _build("resnet9", 3, 32).modules())
    r9 = _build("resnet9", 3, 32, dropout=0.5)
    assert sum(isinstance(mod, nn.Dropout) for mod in r9.modules()) == 2
    assert sum(isinstance(mod, nn.Dropout) for mod in _build("cnn13", 3, 32, dropout=0.5).modules()) == 2
    assert sum(isinstance(mod, nn.Dropout) for mod in _build("alexnet", 3, 32, dropout=0.5).modules()) == 2
    # MC-dropout: dropout train, BN eval -> stochastic outputs
    r9.eval()
    for mod in r9.modules():
        if isinstance(mod, nn.Dropout):
            mod.train()
    x = _x(3, 32)
    with torch.no_grad():
        assert not torch.equal(r9(x), r9(x))


def test_mlp_options_and_features():
    m = _build("mlp", 1, 28, norm="none", hidden=(64, 32))
    assert m.cut_points == ["fc1", "fc2"] and m.feature_dim == 32
    assert [mod.out_features for mod in m.modules() if isinstance(mod, nn.Linear)] == [64, 32, 10]
    m.eval()
    x = _x(1, 28)
    with torch.no_grad():
        assert torch.equal(m.classifier(m.forward_features(x)), m(x))
        _, top = split_model(m, "fc1")
        h = split_model(m, "fc1")[0](x)
        assert torch.equal(top.classifier(top.forward_features(h)), m(x))
    with pytest.raises(ValueError, match="hidden"):
        _build("mlp", 1, 28, hidden=())


def test_vgg16_small_input_keeps_positive_maps():
    m = _build("vgg16", 1, 28).eval()
    bottom, _ = split_model(m, "conv13")
    with torch.no_grad():
        assert bottom(_x(1, 28)).shape == (2, 512, 1, 1)
    pools = sum(isinstance(mod, nn.MaxPool2d) for mod in m.modules())
    assert pools == 4
    assert sum(isinstance(mod, nn.MaxPool2d) for mod in _build("vgg16", 3, 32).modules()) == 5


def test_errors_name_the_key():
    kw = dict(in_channels=3, num_classes=10, image_size=32)
    with pytest.raises(ValueError, match=r"model=.x. is not one of cnn, cnn-afo, mlp, alexnet"):
        build_model("x", **kw)
    with pytest.raises(ValueError, match=r"norm='batch' is not one of bn, gn, none"):
        build_model("cnn", norm="batch", **kw)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="dropout"):
            build_model("cnn", dropout=bad, **kw)
    with pytest.raises(ValueError, match="image_size"):
        build_model("cnn", in_channels=3, num_classes=10, image_size=8)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("cnn", in_channels=3, num_classes=0, image_size=32)
    m = _build("cnn", 3, 32)
    with pytest.raises(ValueError, match=r"cut='x' is not a cut point of model 'cnn'; allowed: conv1, conv2, fc1"):
        split_model(m, "x")
    with pytest.raises(ValueError, match="cut='head'"):
        bottom_state_keys(m, "head")
    assert resolve_cut(m, "") == resolve_cut(m, None) == "conv2"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_split():
    m = _build("resnet18", 3, 32).cuda().eval()
    x = _x(3, 32).cuda()
    with torch.no_grad():
        bottom, top = split_model(m, "layer1")
        assert torch.equal(top(bottom(x)), m(x))


def test_evaluate_does_not_depend_on_its_batch():
    """``evaluate`` batches by device (``eval_batch_size``: 64 on the CPU, 500 on a GPU); in eval
    mode the numbers are the same at any batch (a bad batch is an error naming it)."""
    import numpy as np

    from tasks.augment import Augmenter
    from tasks.data import ArrayDataset
    from tasks.training import eval_batch_size, evaluate

    assert eval_batch_size(torch.device("cpu")) == 64
    assert eval_batch_size(torch.device("cuda")) == 500
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.integers(0, 256, (203, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, 203))
    torch.manual_seed(0)
    m = _build("cnn", 1, 28)
    aug = Augmenter(1, 28, flip=False)
    kw = dict(aug=aug, device=torch.device("cpu"), num_classes=10)
    base = evaluate(m, data, batch_size=500, **kw)
    for bs in (None, 1, 64, 203):
        got = evaluate(m, data, batch_size=bs, **kw)
        assert got["accuracy"] == base["accuracy"] and got["per-class-accuracy"] == base["per-class-accuracy"]
        assert got["loss"] == pytest.approx(base["loss"], rel=1e-5)
    assert m.training  # the mode is restored
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        evaluate(m, data, batch_size=0, **kw)
