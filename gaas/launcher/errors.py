"""The launcher's one error: the mesh could not start, or a piece of it could not be run."""

from __future__ import annotations



class MeshError(RuntimeError):
    """The mesh could not start; the message says which piece and where its log is."""
