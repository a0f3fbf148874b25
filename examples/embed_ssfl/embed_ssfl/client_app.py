"""ClientApp: flower-ssl's SSFL user logic behind this app's own handlers."""
from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from strategies.ssfl import ALGORITHMS

SSFL = ALGORITHMS["ssfl"]

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return SSFL.handle(msg, context)       # one communication period of CRL on unlabeled data


@app.query()
def query(msg: Message, context: Context) -> Message:
    return SSFL.handle(msg, context)       # node-info: partition id (fixed groups, partial participation)
