"""Data: a registry of sources, samplers that split global batches exactly, and loaders."""
