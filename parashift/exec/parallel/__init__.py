"""The interpreter's handlers, one module per parallelism."""
