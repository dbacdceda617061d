"""What the servicer needs of the model table the process hands it (the registry,
one layer above rpc): the routing of a call to its model's worker, the models listed,
and loading and unloading.  A Protocol, so rpc names the shape and imports nothing
from the layer above it."""

from __future__ import annotations

from typing import AsyncIterator, Protocol, Sequence

from ..engine.facade import ModelWorker


class HostedModel(Protocol):
    """One row of ListModels: a model being loaded (``worker`` None) or serving."""

    name: str
    path: str
    worker: ModelWorker | None
    is_default: bool


class HostedModels(Protocol):
    workers: dict[str, ModelWorker]  # name -> the worker serving it

    def worker(self, model: str) -> ModelWorker:
        """The worker serving ``model`` ("" = the default), or the precise refusal."""

    def hosted(self) -> Sequence[HostedModel]:
        """Models being loaded, then the serving ones."""

    def load_stages(self, name: str, path: str, draining: bool) -> AsyncIterator[str]:
        """LoadModel: each stage as it starts, "serving" at the end."""

    async def unload(self, name: str) -> int:
        """UnloadModel: the sequences the model held."""
