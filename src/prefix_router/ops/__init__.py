"""The operator surface, off the data path: metrics and the access log."""
