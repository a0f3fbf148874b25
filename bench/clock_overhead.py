"""What the simulated clock's counting costs, side by side in one run.

    python bench/clock_overhead.py [--repeats 20]

A run with `system=` set counts every node's FLOPs with torch's ``FlopCounterMode``, a Python
dispatch mode that every op then passes through. Three ways to run the same work, timed
interleaved (one repeat of each in turn, so load changes hit all three alike):

* ``plain``: no counter (``system='none'``);
* ``clock``: inside :func:`tasks.work.count_work`, as a node runs under the clock: the
  augmentation is data preparation (:func:`tasks.work.not_billed`) and runs outside the count;
* ``every op``: inside a bare ``FlopCounterMode``, every op dispatched, the augmentation's too.

Two pieces of work on 1x28x28 uint8 batches of 64 (Fashion-MNIST's shape), the library's
``cnn``: a strong view alone, and one FixMatch step (a weak and a strong view of 64 unlabeled
images, the weak view's pseudo-labels without a graph, forward and backward of 64 labeled and
64 strong images, an SGD step). Prints the mean milliseconds and each ratio to ``plain``, then
the FLOPs the clock bills for one call against those a bare counter sees (the same draws).
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
from tasks.models import build_model  # noqa: E402
from tasks.work import count_work  # noqa: E402


def main(repeats: int = 20) -> None:
    torch.manual_seed(0)
    aug = Augmenter(1, 28, flip=False)
    model = build_model("cnn", in_channels=1, num_classes=10, image_size=28)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xl = torch.randint(0, 256, (64, 1, 28, 28), dtype=torch.uint8)
    yl = torch.randint(0, 10, (64,))
    xu = torch.randint(0, 256, (64, 1, 28, 28), dtype=torch.uint8)

    def strong() -> None:
        aug.strong(xu)

    def fixmatch_step() -> None:
        xw, xs = aug.weak_strong(xu)
        with torch.no_grad():
            p = model(xw).softmax(1)
        conf, yp = p.max(1)
        opt.zero_grad()
        loss = F.cross_entropy(model(aug.weak(xl)), yl)
        loss = loss + (F.cross_entropy(model(xs), yp, reduction="none") * (conf >= 0.95)).mean()
        loss.backward()
        opt.step()

    def plain(fn):
        fn()

    def clock(fn):
        with count_work():
            fn()

    def every_op(fn):
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False):
            fn()

    modes = {"plain": plain, "clock": clock, "every op": every_op}
    print(f"torch threads {torch.get_num_threads()}, {repeats} repeats, batch 64 of 1x28x28")
    print(f"{'work':<16}" + "".join(f"{m:>12}" for m in modes) + f"{'clock/plain':>14}{'every op/plain':>16}")
    flops: dict[str, tuple[float, float]] = {}
    for name, fn in (("strong view", strong), ("FixMatch step", fixmatch_step)):
        for run in modes.values():   # warm-up (imports torchvision, allocates)
            run(fn)
        total = dict.fromkeys(modes, 0.0)
        for _ in range(repeats):
            for m, run in modes.items():
                t = time.perf_counter()
                run(fn)
                total[m] += time.perf_counter() - t
        ms = {m: total[m] / repeats * 1000 for m in modes}
        print(f"{name:<16}" + "".join(f"{ms[m]:>10.2f}ms" for m in modes)
              + f"{ms['clock'] / ms['plain']:>13.2f}x{ms['every op'] / ms['plain']:>15.2f}x")
        flops[name] = _flops(fn)
    for name, (billed, every) in flops.items():
        print(f"{name}: FLOPs billed by the clock {billed:.4g}, counted with every op {every:.4g} "
              f"(the augmentation's share {(every - billed) / every:.2g})")


def _flops(fn) -> tuple[float, float]:
    """(FLOPs the clock bills, FLOPs a bare counter sees) of one call, the same draws for both."""
    from torch.utils.flop_counter import FlopCounterMode

    state = torch.get_rng_state()
    with count_work() as w:
        fn()
    torch.set_rng_state(state)
    with FlopCounterMode(display=False) as every:
        fn()
    return w.flops, float(every.get_total_flops())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    main(ap.parse_args().repeats)
