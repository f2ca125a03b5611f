"""Pathways server side: the controller, its scheduler and resource manager, the worker."""

__version__ = "0.1.0"
