"""``paratrain plan``: memory per rank of every layout a cluster allows, ranked (docs/planner.md)."""
