"""Datasets and the resumable, data-parallel batch order."""
