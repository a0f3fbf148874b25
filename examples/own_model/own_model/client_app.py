"""ClientApp: flower-ssl's client logic on this app's own model and each node's own shard."""
from __future__ import annotations

from flwr.app import Context

from own_model.task import SmallCNN, node_shard, split_pair
from strategies.client import client_app
from strategies.fedavg import FedAvgClient
from strategies.fedshvr.fedshvr import FedSHVRClient
from strategies.scala.scala import ScalaClient
from strategies.semisfl.semisfl import SemiSFLClient
from strategies.ssfl.ssfl import SSFLClient
from strategies.umpfssl.umpfssl import UMPFSSLClient


def shard(context: Context):
    return node_shard(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))


def labeled(context: Context):                 # every image of the shard is labeled
    return {"labeled": shard(context)}


def unlabeled(context: Context):               # no label on the node
    x, _ = shard(context)
    return {"unlabeled": x}


def partly_labeled(context: Context):          # 10 % labeled; UM-pFSSL also keeps 20 % to test on
    x, y = shard(context)
    k, t = len(x) // 10, len(x) // 5
    return {"labeled": (x[:k], y[:k]), "unlabeled": x[k:len(x) - t], "test": (x[len(x) - t:], y[len(x) - t:])}


app = client_app(
    FedAvgClient(SmallCNN(), labeled),
    SSFLClient(SmallCNN(), unlabeled),
    SemiSFLClient(split_pair(), unlabeled),
    ScalaClient(split_pair(), labeled),
    FedSHVRClient(SmallCNN(), partly_labeled),
    UMPFSSLClient(SmallCNN(), partly_labeled),
)
