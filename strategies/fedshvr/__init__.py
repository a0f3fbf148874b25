"""Fed-SHVR: client-labeled federated semi-supervised learning under class mismatch, with its ablations and the baselines of its tables (Fed-Pseudo, Fed-MT, Fed-SL)."""
