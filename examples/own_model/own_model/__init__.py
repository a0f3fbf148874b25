"""A Flower app of its own (own model, own dataset, own partition) that runs flower-ssl's algorithms."""
