"""Training one rank: what it trains, built in the loop's order (``rank_setup.py``: process and mesh, data,
the laid-out model), and the loop itself (``trainer.py``). Run-level features that act at a few points of
the loop (replica groups, the non-finite guard, checkpoint policy) are objects beside it that the loop calls."""
