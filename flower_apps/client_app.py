"""The ClientApp: route each message to the handler of the algorithm named in it.

Every server message carries ``config["algo"]`` (the registry name) and its action in
Flower's message type: ``train``, ``evaluate``, or ``query.<action>`` (split-learning
steps, helper selection, the ``node-info`` partition query). Each action of
:func:`strategies.registry.query_actions` is registered with Flower's own routing: the
actions of every registered algorithm, the library's and those of the installed packages that
declare algorithm modules under the entry-point group ``flower_ssl.algorithms``. An algorithm
from a module that is not an installed package is imported from the run config's
``algo-modules``.
"""
from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from strategies.client import register_actions
from strategies.registry import algorithm_for, query_actions


def dispatch(msg: Message, context: Context) -> Message:
    return algorithm_for(msg, context=context).handle(msg, context)


app = register_actions(ClientApp(), ["train", "evaluate", *query_actions()], dispatch)
