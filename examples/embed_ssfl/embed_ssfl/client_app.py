"""ClientApp: flower-ssl's SSFL user logic behind this app's own handlers."""
from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from strategies.ssfl import client_info, client_train

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return client_train(msg, context)      # one communication period of CRL on unlabeled data


@app.query()
def query(msg: Message, context: Context) -> Message:
    return client_info(msg, context)       # partition-id for the fixed groups (ssfl.groups > 1)
