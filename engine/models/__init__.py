"""Model implementations over flat token batches and the attention backend interface."""
