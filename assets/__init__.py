"""Data only: known hardware, known model shapes, prompts, styles."""
