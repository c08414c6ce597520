"""Developer tools of this repository (not shipped)."""
