"""What a round moves and computes, counted from the model: SCALA's Table V, recomputed, and
Semi-SFL's bytes per client and round against full-model FL.

    python -m flower_apps.cost scala-table5
    python -m flower_apps.cost semisfl-round --k-u 50

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


#: (model, cut) of the Semi-SFL comparison: the runs' small CNN and the paper's AlexNet
SEMISFL_MODELS = (("cnn", "conv2"), ("alexnet-semisfl", "conv5"))
MB = 1e6


def semisfl_round_bytes(model_name: str, cut: str, k_u: int, batch: int = 64,
                        input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10) -> dict[str, float]:
    """What one Semi-SFL client and one full-model client move in a round, in bytes, as the
    runtime counts them (``bytes.*`` metrics): Semi-SFL uploads the student and the teacher
    features of each of its ``k_u`` batches and its bottom once, and downloads a gradient per
    batch, each batch's pseudo-labels and mask (int16 + uint8 per sample, the hidden-label
    metrics, on by default), the bottom and the teacher bottom; a full-model client (SemiFL) moves
    the model once each way, FedSwitch downloads the teacher too."""
    from split_layer.cut import cut_cost
    from tasks.models import build_model

    model = build_model(model_name, in_channels=input_shape[0], num_classes=num_classes, image_size=input_shape[1])
    c = cut_cost(model, cut, input_shape, batch, k_u, label_bytes=3)
    feats, bottom, full = c["activation-bytes"], c["bottom-bytes"], c["model-bytes"]
    return {"model": full, "bottom": bottom, "features": feats,
            "semisfl-up": 2 * k_u * feats + bottom,
            "semisfl-down": k_u * (c["gradient-bytes"] + c["label-bytes"]) + 2 * bottom,
            "full-up": full, "full-down": full, "fedswitch-down": 2 * full,
            "bottom-train-flops": c["bottom-train-flops"], "model-train-flops": c["model-train-flops"]}


def semisfl_round(k_u: int, batch: int = 64) -> str:
    lines = [f"Semi-SFL per client and round against full-model FL: K_u = {k_u} iterations of B = {batch} "
             "samples, 1x28x28 inputs, 10 classes (MB = 1e6 bytes, as the runs' bytes.* metrics)", "",
             "| model (cut) | model | bottom | features of a batch | Semi-SFL up / down | SemiFL up / down "
             "| FedSwitch up / down | SemiFL's bytes / Semi-SFL's | client GFLOPs per iteration: bottom / full model "
             "(fwd + bwd) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, cut in SEMISFL_MODELS:
        b = semisfl_round_bytes(name, cut, k_u, batch)
        semi = b["semisfl-up"] + b["semisfl-down"]
        lines.append(
            f"| `{name}` ({cut}) | {b['model'] / MB:.2f} | {b['bottom'] / MB:.2f} | {b['features'] / MB:.3f} "
            f"| {b['semisfl-up'] / MB:.1f} / {b['semisfl-down'] / MB:.1f} | {b['full-up'] / MB:.1f} / "
            f"{b['full-down'] / MB:.1f} | {b['full-up'] / MB:.1f} / {b['fedswitch-down'] / MB:.1f} "
            f"| {(b['full-up'] + b['full-down']) / semi:.2f}x | {b['bottom-train-flops'] / 1e9:.3f} / "
            f"{b['model-train-flops'] / 1e9:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flower_apps.cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", choices=("scala-table5", "semisfl-round"))
    ap.add_argument("--batch", type=int, default=None,
                    help="samples per client and iteration (scala-table5: 32 = the paper's 320 / 10; "
                         "semisfl-round: 64, the runs' batch-size)")
    ap.add_argument("--k-u", type=int, default=50, help="semisfl-round: cross-entity iterations per round "
                                                        "(the paper's K_u = 50)")
    args = ap.parse_args(argv)
    for name, v in (("--batch", args.batch), ("--k-u", args.k_u)):
        if v is not None and v < 1:
            ap.error(f"{name}={v}: must be a positive integer")
    if args.table == "scala-table5":
        print(scala_table5(args.batch or 32))
    else:
        print(semisfl_round(args.k_u, args.batch or 64))
    return 0


if __name__ == "__main__":
    from flower_apps.cli import run

    run(main)
