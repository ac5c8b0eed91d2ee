"""Job control: a live job across hosts, its elastic world, recovery from a lost host and snapshots."""
