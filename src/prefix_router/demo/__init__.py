"""`prefix-router demo`: the router in front of a simulated fleet, on one machine, no GPU."""
