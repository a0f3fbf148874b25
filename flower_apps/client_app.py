"""The ClientApp: route each message to the handler of the algorithm named in it.

Every server message carries ``config["algo"]`` (the registry name) and its action in
Flower's message type: ``train``, ``evaluate``, or ``query.<action>`` (split-learning
steps, helper selection, the ``node-info`` partition query). Each action of
:func:`strategies.registry.query_actions` is registered with Flower's own routing. An
algorithm from outside the library is imported from the run config's ``algo-modules``.
"""
from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from split_layer.records import CONFIG_KEY
from strategies.client import register_actions
from strategies.registry import algorithm_names, get_algorithm, import_modules, query_actions


def dispatch(msg: Message, context: Context) -> Message:
    cfg = msg.content.config_records.get(CONFIG_KEY)
    if cfg is None or "algo" not in cfg:
        raise ValueError(f"malformed message: no '{CONFIG_KEY}' record with an 'algo' entry")
    algo = str(cfg["algo"])
    if algo not in algorithm_names():
        import_modules(str((context.run_config or {}).get("algo-modules", "")))
    return get_algorithm(algo).handle(msg, context)


app = register_actions(ClientApp(), ["train", "evaluate", *query_actions()], dispatch)
