"""The split-learning extension: cut a model into bottom/top parts, exchange activations and gradients, count bytes."""
