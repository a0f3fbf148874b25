"""How destructive is each view? Accuracy of a model trained on clean MNIST-5k, tested on
augmented views of the 1,000 held-out images (a probe, not a test).

    python bench/augment_strength.py                 # MLP and CNN
    python bench/augment_strength.py --models mlp    # MLP only

A model (``tasks.models.build_model``: ``mlp`` / ``cnn``, BatchNorm) is trained with plain
SGD for a few epochs on the clean, test-normalised 4,000 training images of the embedded
``mnist5k`` set (``tasks.data.load_dataset``, default 20 % hold-out), then evaluated on the
1,000 test images through each view:

* ``clean``: :meth:`Augmenter.test`;
* ``weak``: the crop (3 px reflect-padded translation on 28x28, no flip for digits);
* ``strong``: the current strong view (FixMatch's RandAugmentMC(2, 10) + Cutout of
  ``int(0.5 * 28)`` = 14 px, as the authors' PyTorch code cuts 16 px on 32x32), as
  ``tasks.env.make_augmenter`` builds it;
* ``strong, cutout 0.25``: the same policy with a quarter-size Cutout (7 px);
* ``strong, no cutout``: the policy alone;
* ``old strong``: the policy ``tasks.augment`` does not use (too strong for digits), reproduced
  here: weak crop, then per sample
  torchvision ``v2.RandAugment(num_ops=1)`` twice, each at a magnitude bin drawn from 1..30
  (of 31) and always applied, then a 14-px Cutout filled with 127.

Each augmented view is drawn ``--repeats`` times (seeded) and every model is evaluated on
the same draws; the table gives the mean and the spread (max - min) of the accuracy, and
the augmentation time per image. ``--train-view weak`` trains on a fresh weak view every
epoch instead (the MLP is not translation invariant: trained on clean images only, the
3-px crop alone costs it much of its accuracy).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from tasks.augment import Augmenter  # noqa: E402
from tasks.data import load_dataset  # noqa: E402
from tasks.models import build_model  # noqa: E402


def old_strong_uint8(aug: Augmenter, x: torch.Tensor) -> torch.Tensor:
    """The previous strong policy (torchvision RandAugment at up to its maximum + 14-px Cutout)."""
    from torchvision.transforms import v2

    ra = v2.RandAugment(num_ops=1)
    x = aug.weak_uint8(x)
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        img = x[i]
        for _ in range(2):
            ra.magnitude = int(torch.randint(1, ra.num_magnitude_bins, ()))
            img = ra(img)
        out[i] = img
    half = Augmenter(aug.in_channels, aug.image_size, flip=aug.flip, cutout_size=aug.image_size // 2)
    return half._cutout(out)


def train(name: str, x: torch.Tensor, y: torch.Tensor, aug: Augmenter, *, epochs: int, lr: float,
          batch_size: int, seed: int, weak: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(name, in_channels=aug.in_channels, num_classes=10, image_size=aug.image_size)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    xs = aug.test(x)
    model.train()
    for _ in range(epochs):
        if weak:
            xs = aug.weak(x)
        perm = torch.randperm(len(y))
        for k in range(0, len(y), batch_size):
            idx = perm[k:k + batch_size]
            loss = F.cross_entropy(model(xs[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="draws of each augmented view")
    p.add_argument("--train-view", choices=("clean", "weak"), default="clean",
                   help="train on clean images (default) or on fresh weak views every epoch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]

    bundle = load_dataset("mnist5k", seed=args.seed)
    xtr, ytr = torch.from_numpy(bundle.train.x), torch.from_numpy(bundle.train.y)
    xte, yte = torch.from_numpy(bundle.test.x), torch.from_numpy(bundle.test.y)
    c, s = bundle.in_channels, bundle.image_size
    aug = Augmenter(c, s, flip=not bundle.is_digits)  # as tasks.env.make_augmenter
    quarter = Augmenter(c, s, flip=aug.flip, cutout_fraction=0.25)
    bare = Augmenter(c, s, flip=aug.flip, cutout=False)
    views = [
        ("weak", aug.weak_uint8),
        (f"strong (RandAugmentMC, cutout {aug.cutout_size}px)", aug.strong_uint8),
        (f"strong, cutout 0.25 ({quarter.cutout_size}px)", quarter.strong_uint8),
        ("strong, no cutout", bare.strong_uint8),
        (f"old strong (tv RA 1..30 x2, cutout {s // 2}px)", lambda x: old_strong_uint8(aug, x)),
    ]
    print(f"mnist5k: train {len(ytr)}, test {len(yte)}, {c}x{s}x{s}; {args.train_view} training, plain SGD "
          f"lr={args.lr}, batch {args.batch_size}, {args.epochs} epochs; {args.repeats} draws per view "
          f"(the same images for every model); torch threads {torch.get_num_threads()}")
    trained = {}
    for name in models:
        t0 = time.perf_counter()
        trained[name] = train(name, xtr, ytr, aug, epochs=args.epochs, lr=args.lr,
                              batch_size=args.batch_size, seed=args.seed, weak=args.train_view == "weak")
        print(f"  trained {name} in {time.perf_counter() - t0:.1f} s")
    for _, fn in views:  # warm-up (torchvision import) outside the timings
        fn(xte[:256])

    head = "".join(f" {m + ' acc':>9} {'spread':>6}" for m in models)
    print(f"\n{'view':<44}{head} {'aug ms/img':>10}")
    row = "".join(f" {accuracy(trained[m], aug.test(xte), yte):9.3f} {'':>6}" for m in models)
    print(f"{'clean':<44}{row}")
    for label, fn in views:
        accs: dict[str, list[float]] = {m: [] for m in models}
        secs = []
        for r in range(args.repeats):
            torch.manual_seed(1000 + r)
            t = time.perf_counter()
            xa = aug.normalize(fn(xte))
            secs.append(time.perf_counter() - t)
            for m in models:
                accs[m].append(accuracy(trained[m], xa, yte))
        row = "".join(f" {sum(a) / len(a):9.3f} {max(a) - min(a):6.3f}" for a in accs.values())
        print(f"{label:<44}{row} {sum(secs) / len(secs) * 1000 / len(yte):10.2f}", flush=True)


if __name__ == "__main__":
    main()
