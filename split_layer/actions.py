"""The split layer's actions: ``split`` (one exchange of a split round) and ``split-info`` (a
split node's one-time self-description: partition id, ``|D_k|``, and its label histogram where
the algorithm asks for it). ``split-info`` asks a node about itself, as the core's ``node-info``
does (:data:`strategies.core.records.INFO_ACTIONS`): no user config, node state not saved."""

SPLIT = "split"
SPLIT_INFO = "split-info"
__all__ = ["SPLIT", "SPLIT_INFO"]
