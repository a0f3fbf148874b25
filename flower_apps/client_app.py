"""The ClientApp: route each message to the handler of the algorithm named in it.

Every server message carries ``config["algo"]`` (the registry name) and its action in
Flower's message type: ``train``, ``evaluate``, or ``query.<action>`` (split-learning
steps, helper selection, the ``node-info`` partition query). Each action of
:data:`strategies.registry.QUERY_ACTIONS` is registered with Flower's own routing.
"""
from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from split_layer.records import CONFIG_KEY
from strategies.client import register_actions
from strategies.registry import QUERY_ACTIONS, get_algorithm


def dispatch(msg: Message, context: Context) -> Message:
    cfg = msg.content.config_records.get(CONFIG_KEY)
    if cfg is None or "algo" not in cfg:
        raise ValueError(f"malformed message: no '{CONFIG_KEY}' record with an 'algo' entry")
    return get_algorithm(str(cfg["algo"])).handle(msg, context)


app = register_actions(ClientApp(), ["train", "evaluate", *QUERY_ACTIONS], dispatch)
