"""Checkpoints: checks and safe loading of DCP folders, Hugging Face import and export, upcycling."""
