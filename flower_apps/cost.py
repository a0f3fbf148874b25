"""What a round moves and computes, counted from the model: SCALA's Table V, recomputed.

    python -m flower_apps.cost scala-table5

SCALA's Table V (CIFAR-10, AlexNet cut at conv2, 10 of 100 clients per round, server batch
B = 320, so B_k = 32 per client; I = 10 / 20 / 30 local iterations) gives, per client and
global iteration, its communication (5.07 / 10.07 / 15.08 MB) and client compute (3.59 /
7.18 / 10.77 GFLOPs) against 14.76 MB and 44.69 / 89.38 / 134.07 GFLOPs for full-model FL.
This command counts the same quantities from this library's AlexNet reconstruction
(:func:`tasks.models.alexnet`, 3x32x32 inputs) with torch's FLOP counter
(:func:`split_layer.cut.cut_cost`) and prints them beside the paper's, in the paper's
accounting (its MB are MiB; activations up x I + the client model once; FLOPs of the forward
pass, 2 per multiply-add) and in this library's (every byte both ways: activations and labels
up, gradients down, the client model down and up; forward + backward FLOPs).
"""
from __future__ import annotations

import argparse
import sys

PAPER_TABLE5 = {10: (5.07, 3.59, 44.69), 20: (10.07, 7.18, 89.38), 30: (15.08, 10.77, 134.07)}
PAPER_FULL_MB = 14.76
MIB = 2 ** 20


def scala_table5(batch: int = 32) -> str:
    from tasks.models import build_model
    from split_layer.cut import cut_cost

    model = build_model("alexnet", in_channels=3, num_classes=10, image_size=32)
    c = cut_cost(model, "conv2", (3, 32, 32), batch, 1)
    lines = [
        f"SCALA Table V, recomputed: AlexNet (tasks.models.alexnet, {sum(p.numel() for p in model.parameters()):,} "
        f"parameters) cut at conv2, 3x32x32 inputs, B_k = {batch} per client (B = 320 over 10 clients)",
        "",
        "| I | paper: MB per client and round | ours, paper's accounting (MiB) | ours, every byte both ways (MiB) "
        "| paper: client GFLOPs | ours: client GFLOPs forward (fwd + bwd) | paper: FL GFLOPs "
        "| ours: full-model GFLOPs forward (fwd + bwd) |",
        "|---|---|---|---|---|---|---|---|"]
    for iters, (p_mb, p_gf, p_fl) in PAPER_TABLE5.items():
        paper_acc = (c["activation-bytes"] * iters + c["bottom-bytes"]) / MIB
        every = ((c["activation-bytes"] + c["label-bytes"] + c["gradient-bytes"]) * iters
                 + 2 * c["bottom-bytes"]) / MIB
        lines.append(
            f"| {iters} | {p_mb:.2f} | {paper_acc:.2f} | {every:.2f} | {p_gf:.2f} "
            f"| {c['bottom-forward-flops'] * iters / 1e9:.2f} ({c['bottom-train-flops'] * iters / 1e9:.2f}) "
            f"| {p_fl:.2f} | {c['model-forward-flops'] * iters / 1e9:.2f} ({c['model-train-flops'] * iters / 1e9:.2f}) |")
    lines += [
        "",
        f"Full-model FL per client and round: paper {PAPER_FULL_MB:.2f} MB; ours {c['model-bytes'] / MIB:.2f} MiB one "
        f"way ({2 * c['model-bytes'] / MIB:.2f} MiB down and up). Per iteration: activations "
        f"{c['activation-bytes'] / MIB:.3f} MiB up, client model {c['bottom-bytes'] / MIB:.4f} MiB.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flower_apps.cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", choices=("scala-table5",))
    ap.add_argument("--batch", type=int, default=32, help="samples per client and iteration (paper: 320 / 10)")
    args = ap.parse_args(argv)
    print(scala_table5(args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
