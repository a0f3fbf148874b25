"""The core of the round loop, which knows nothing of split learning nor of any algorithm;
the split-learning layer and every strategy build on it.

* :mod:`strategies.core.records` -- record names, conversions, actions, consent, the node's env
  (``client_env``), error replies (``describe_error``), ``metric_safe``.
* :mod:`strategies.core.round_policy` -- :class:`RoundPolicy` (sampling, waiting, bounds, system).
* :mod:`strategies.core.node_directory` -- :class:`NodeDirectory` (who each node is) and
  :class:`NodeSampler` (the connected nodes, ``node-info``, each round's seeded sample).
* :mod:`strategies.core.partition_count` -- how many partitions the run's data is split into.
* :mod:`strategies.core.messages` -- :class:`MessageContent`: the records of every message.
* :mod:`strategies.core.exchange_window` -- :class:`ExchangeWindow`: windowed send/receive,
  poll back-off, faults; :mod:`strategies.core.deadlines`: when a reply is due.
* :mod:`strategies.core.byte_meter` -- :class:`ByteMeter`, :func:`array_bytes`.
* :mod:`strategies.core.clock` -- :class:`SimClock`: the simulated system's clock.
* :mod:`strategies.core.folds` -- :class:`TrainFold` (FedAvg as a fold) and the FedAvg-shaped round.
* :mod:`strategies.core.evaluation` -- federated evaluation through Flower's evaluate hooks.
* :mod:`strategies.core.round_guard` -- the upload bound and the divergence roll-back.
* :mod:`strategies.core.simulation` -- whether the nodes are simulated on this machine.
* :mod:`strategies.core.options` -- a strategy's keyword options routed to its configs.
* :mod:`strategies.core.round_loop` -- :class:`RoundLoopStrategy`, the loop that composes them.
"""
