"""The split-learning extension: cut a model into bottom/top parts, exchange activations and gradients, count bytes.

Modules (algorithm-free; algorithms live in ``strategies/``):

* :mod:`split_layer.cut` -- ``split_model(model, cut) -> (bottom, top)`` sharing parameters.
* :mod:`split_layer.runtime` -- ``SplitRuntime``: the server-side round (begin, I fused
  exchanges, end, aggregate), faults, byte accounting by kind.
* :mod:`split_layer.worker` -- ``make_split_handlers(SplitClientHooks())``: the ClientApp
  worker (state in ``context.state``, exact recomputation, gradient validation).
* :mod:`split_layer.transport` -- ``Transport``/``Envelope``; ``FlowerTransport`` (Flower
  messages), ``LocalGrid`` (in-process runs, tests and benchmarks), ``TRANSPORTS`` (the
  ``split-transport`` choices).
* :mod:`split_layer.stream` -- the gRPC stream transport (``StreamTransport``,
  ``StreamClient``, ``StreamOptions``), re-exported from its modules ``stream_frames``,
  ``stream_security``, ``stream_options``, ``stream_server``, ``stream_guard``,
  ``stream_transport`` and ``stream_client``.
* :mod:`split_layer.simulation` -- whether this process runs in Flower's simulation engine,
  and how many ClientApps it runs at once.
* :mod:`split_layer.validation` -- shape/dtype/NaN/Inf checks of tensors crossing the cut.
"""
