"""acache: a write-back cache for training checkpoints.

The public Python API is small: read a file's persistence state and wait for the
durability barrier.  Everything else is reached through the ``acache`` CLI.
"""
from acache.api import file_state, flush

__version__ = "0.1.0"
__all__ = ["file_state", "flush", "__version__"]
