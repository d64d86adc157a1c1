"""Parallel layouts: composable functions ``apply_*(model, mesh, *, options)`` over a built model.

They know nothing of trainers, data or particular models; they read only the model's ParallelPlan.
"""
