"""Plain-torch parts of SCALA's tables: FedConcat's concatenated model and its k-means, and the model-inversion attacker of the privacy table. No Flower."""
