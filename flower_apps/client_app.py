"""The ClientApp: dispatch each message to the handler of the algorithm named in it.

Every server message carries ``config["algo"]`` (the registry name). ``train`` messages
go to the algorithm's ``"train"`` handler, ``evaluate`` to ``"evaluate"``, and ``query``
messages to the handler named by ``config["op"]`` (split-learning steps, helper downloads).
"""
from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from strategies.common import CONFIG_KEY, NODE_INFO_OP, node_info
from strategies.registry import get_algorithm

app = ClientApp()


def dispatch(msg: Message, context: Context, op: str | None = None) -> Message:
    cfg = msg.content.config_records.get(CONFIG_KEY)
    if cfg is None or "algo" not in cfg:
        raise ValueError(f"malformed message: no '{CONFIG_KEY}' record with an 'algo' entry")
    spec = get_algorithm(str(cfg["algo"]))
    kind = msg.metadata.message_type.split(".")[0]
    # as the ClientApp routes: train/evaluate messages by type, queries by their config "op"
    op = op or (kind if kind in ("train", "evaluate") else str(cfg.get("op", "")))
    if op == NODE_INFO_OP:  # every algorithm: the server learns partition ids to sample in that order
        return node_info(msg, context)
    handler = spec.client.get(op)
    if handler is None:
        raise ValueError(f"algorithm '{spec.name}' has no client handler '{op}'; it has: "
                         f"{', '.join(sorted(spec.client)) or 'none'}")
    return handler(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return dispatch(msg, context, "train")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return dispatch(msg, context, "evaluate")


@app.query()
def query(msg: Message, context: Context) -> Message:
    return dispatch(msg, context)
