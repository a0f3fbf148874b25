"""The ClientApp: dispatch each message to the handler of the algorithm named in it.

Every server message carries ``config["algo"]`` (the registry name). ``train`` messages
go to the algorithm's ``"train"`` handler, ``evaluate`` to ``"evaluate"``, and ``query``
messages to the handler named by ``config["op"]`` (split-learning steps, helper downloads).
"""
from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from strategies.common import CONFIG_KEY
from strategies.registry import get_algorithm

app = ClientApp()


def dispatch(msg: Message, context: Context, op: str | None = None) -> Message:
    cfg = msg.content.config_records.get(CONFIG_KEY)
    if cfg is None or "algo" not in cfg:
        raise ValueError(f"malformed message: no '{CONFIG_KEY}' record with an 'algo' entry")
    return get_algorithm(str(cfg["algo"])).handle(msg, context, op)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return dispatch(msg, context, "train")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return dispatch(msg, context, "evaluate")


@app.query()
def query(msg: Message, context: Context) -> Message:
    return dispatch(msg, context)
