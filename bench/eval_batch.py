"""Seconds of one evaluation pass (forward only, eval mode) over the batch size, per model, side
by side in one run: the measurement behind :func:`tasks.training.eval_batch_size`.

    python bench/eval_batch.py                       # 1 thread, 1,000 images of 1x28x28
    python bench/eval_batch.py --threads 2 --image 3x32
    python bench/eval_batch.py --device cuda --batches 64 500 2000

Prints the best of ``--repeats`` passes per batch size, and each size's time over the library's
default batch on that device (``ratio`` < 1: that batch is faster than the default).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from tasks.models import build_model  # noqa: E402
from tasks.training import eval_batch_size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["cnn", "vgg11-small", "resnet9", "resnet18", "cnn13"])
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 64, 128, 256, 500, 1000])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--image", default="1x28", help="CxS: channels x side (default 1x28)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    c, s = (int(v) for v in args.image.split("x"))
    default = eval_batch_size(device)
    batches = sorted(set(args.batches) | {default})
    x = torch.randn(args.images, c, s, s, device=device)
    print(f"{args.images} images {c}x{s}x{s}, {args.threads} thread(s), {device}; library default batch {default}")

    def one_pass(model: torch.nn.Module, bs: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(x), bs):
                model(x[i:i + bs])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for name in args.models:
        model = build_model(name, in_channels=c, num_classes=10, image_size=s).to(device).eval()
        one_pass(model, default)  # warm-up
        best = {bs: min(one_pass(model, bs) for _ in range(args.repeats)) for bs in batches}
        cells = " | ".join(f"{bs}: {t:6.2f} s ({t / best[default]:.2f})" for bs, t in best.items())
        print(f"{name:12s} {cells}", flush=True)


if __name__ == "__main__":
    main()
