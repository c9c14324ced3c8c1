"""Runnable examples (from a checkout: ``python -m examples.<name>``)."""
