"""An example third-party pagedcore backend: paged attention via torch SDPA.

Only the light descriptor is imported here; the torch-using classes load when the backend is
used (see `ToySdpaBackend.get_impl_cls`).
"""

from pagedcore_toy_sdpa.backend import ToySdpaBackend

__all__ = ["ToySdpaBackend"]
__version__ = "0.1.0"
