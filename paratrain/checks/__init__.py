"""Whole-config checks, before anything runs: ``preflight`` (every problem at once, before any process
starts), the pipeline's (``pipeline.py``: split points, schedule shape, options that contradict it) and
``ineffective_options`` (warnings for options that have no effect under the layout).

These see the root config and ask the packages they check (callbacks, checkpoint, data, evaluation, optim,
parallel, tracking) for their own section's check, so they sit above all of them: ``config/`` below holds
only the schema, loading and reference docs."""
