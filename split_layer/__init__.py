"""The split-learning extension: cut a model into bottom/top parts, exchange activations and gradients, count bytes.

Modules (algorithm-free; algorithms live in ``strategies/``):

* :mod:`split_layer.cut` -- ``split_model(model, cut) -> (bottom, top)`` sharing parameters.
* :mod:`split_layer.runtime` -- ``SplitRuntime``: the server-side round (begin, I fused
  exchanges, end, aggregate), faults, byte accounting by kind.
* :mod:`split_layer.worker` -- ``make_split_handlers(SplitClientHooks())``: the ClientApp
  worker (state in ``context.state``, exact recomputation, gradient validation).
* :mod:`split_layer.transport` -- ``Transport``/``Envelope``; ``FlowerTransport`` (Flower
  messages) and ``LocalGrid`` (in-process, tests and benchmarks).
* :mod:`split_layer.validation` -- shape/dtype/NaN/Inf checks of tensors crossing the cut.
"""
