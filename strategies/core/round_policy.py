"""How a run's rounds are run: :class:`RoundPolicy` (sampling, waiting, the minimum to
aggregate, the bounds, the simulated system). The run config's keys of the same names
(``flower_apps.config.AppConfig``) take its knobs; a strategy takes them as keyword options.
"""
from __future__ import annotations

from dataclasses import dataclass

from tasks.config import knob

__all__ = ["RoundPolicy"]


@dataclass
class RoundPolicy:
    """How rounds are run: sampling, waiting and the minimum to aggregate. The run config's
    keys of the same names (``flower_apps.config.AppConfig``) take these knobs."""

    fraction_train: float = knob(1.0, lo=0.0, hi=1.0, lo_open=True, help="share of nodes sampled per round")
    min_nodes: int = knob(2, lo=1, help="fewest nodes a round needs; fewer usable replies skip the round")
    round_timeout: float = knob(600.0, lo=0.0, lo_open=True,
                                help="seconds to wait for a node's reply, counted from when its instruction was sent")
    startup_timeout: float = knob(120.0, lo=0.0, help="extra seconds a node's first instruction of the run may take "
                                                      "beyond round-timeout (a cold ClientApp start: process or Ray "
                                                      "actor, imports, data); logged when used")
    wait_for_nodes: float = knob(300.0, lo=0.0, help="seconds to wait at the start for the run's SuperNodes to "
                                                     "connect: min-nodes of them, and in a simulation every one "
                                                     "(the num-partitions the nodes state)")
    payload_bound: float = knob(10.0, lo=0.0, help="split algorithms: a float stream a node uploads (activations) "
                                                   "whose RMS is more than this many times the run's running median "
                                                   "for that stream is refused and the node dropped from the round "
                                                   "(0 = off); see docs/deployment.md")
    upload_norm_bound: float = knob(0.0, lo=0.0, help="largest L2 distance of an uploaded model (or a split node's "
                                                      "final bottom) from the model the server holds; a larger upload "
                                                      "is refused and its node dropped from the round (0 = off)")
    loss_bound: float = knob(10000.0, lo=0.0, help="a round whose model's test loss is NaN or infinite, whose train-loss is infinite, "
                                                   "or either more than this many times max(ln(classes), its median over "
                                                   "the run's earlier rounds), is not applied (the strategy's state is "
                                                   "rolled back) and is reported as diverged (0 = refuse non-finite "
                                                   "losses only); a divergence detector, not a quality filter")
    max_in_flight: int = knob(0, lo=0, help="most instructions of a round out at once, refilled as replies come "
                                            "back and each reply folded into the aggregate as it arrives (0 = auto: "
                                            "in the simulation engine, where the ClientApps share this machine's CPUs, "
                                            "twice its CPUs or a quarter second of replies, whichever is more; every "
                                            "sampled node at once in a deployment)")
    upload_weight: str = knob("dataset-size", choices=("dataset-size", "processed-examples"),
                              help="full-model servers (FedAvg and the algorithms that keep its mean): the weight of a "
                                   "node's upload, the size of its training set (the reply's num-examples: McMahan et "
                                   "al. 2017's n_k) or the samples it processed in the round (its processed-examples: "
                                   "with local-steps set every node that holds a full batch weighs the same); see "
                                   "docs/baselines.md")
    system: str = knob("none", help="the simulated system whose clock times every round (sim-seconds in the "
                                    "metrics): none, a preset (semisfl, scala) or the path of a .toml file; "
                                    "see docs/config.md")
    eval_every: int = knob(1, lo=1, help="evaluate every this many rounds, and always after round 0 and the last "
                                         "round: the server's test of the global model and, for personalised "
                                         "algorithms, every client's test of its own model (long runs: evaluation "
                                         "is a share of a round's time)")
    stop_accuracy: float = knob(0.0, lo=0.0, hi=1.0,
                                help="stop the run after the first evaluated round whose server accuracy reaches "
                                     "this (a time-to-target run: every round before it is what the full run does, "
                                     "the schedules keep num-rounds as their horizon; the round's metrics say "
                                     "stopped-at-target, and a resume does not go past it); 0: run every round")

    def validate(self) -> None:
        """A ``ConfigError`` naming the key where a value is not usable (``system``: a preset,
        a readable TOML file or ``none``)."""
        from tasks.system import load_system

        load_system(self.system)
