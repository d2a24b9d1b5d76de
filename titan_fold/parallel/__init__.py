"""Applying the folded layout to a model: meshes, placements, TP/SP/CP, EP x ETP, FSDP2, pipelining, clipping."""
