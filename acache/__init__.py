"""acache: a write-back cache for training checkpoints.

The public Python API is small: read a file's persistence state and wait for the
durability barrier.  Everything else is reached through the ``acache`` CLI.
"""
from acache.api import file_state, flush

__all__ = ["file_state", "flush"]
