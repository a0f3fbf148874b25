"""A third-party Flower app that reuses flower-ssl's SSFL algorithm (no flower_apps)."""
