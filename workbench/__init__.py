"""The workbench: notebook controls and live views on the production kernels."""

__all__: list[str] = []
