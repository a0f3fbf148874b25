"""Plain-torch parts of UM-pFSSL and its baselines: helper selection, the local distillation on soft pseudo-labels, and pFedMe's local update. No Flower."""
