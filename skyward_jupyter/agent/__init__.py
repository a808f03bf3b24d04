"""The code that runs on every rank: ``python -m skyward_jupyter.agent``."""
