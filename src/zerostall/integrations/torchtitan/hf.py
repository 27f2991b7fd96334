"""The final model exported as Hugging Face safetensors, its keys mapped by torchtitan's own ``sd_adapter``."""

from __future__ import annotations

import logging
import shutil
from typing import Any

import torch

from ... import api
from ...collectives import Group
from ...interop.exporting import ExportInfo

log = logging.getLogger(__name__)


def export_hf(model_state: dict[str, Any], sd_adapter: Any, out: str, group: Group) -> ExportInfo | None:
    """Write ``sd_adapter.to_hf(model_state)`` to the local directory ``out`` as safetensors
    (sharded with an index past 5GB). Collective: every rank saves its shards into a staging
    checkpoint beside ``out`` (DTensors stay sharded), rank 0 exports it through ``zs.export``
    (checksums verified as read) and deletes it; done on every rank when one returns, and a failure
    raised on every rank. Returns the export's info on rank 0."""
    hf_state = sd_adapter.to_hf(model_state)
    staging = out.rstrip("/") + ".zerostall-staging"
    api.save(hf_state, staging, process_group=group.pg, overwrite=True)  # over one a stopped export left
    info: ExportInfo | None = None

    def export() -> bytes:
        nonlocal info
        info = api.export(ck, out, format="hf", overwrite=True)
        log.info("exported the model's Hugging Face weights to %s", out)
        return b""

    try:
        with api.open(staging, process_group=group.pg) as ck:
            group.agree(export)  # rank 0's failure is raised on every rank
    finally:
        if group.pg is not None:
            torch.distributed.barrier(group.pg)  # every rank has closed the staging checkpoint
        if group.is_coordinator:
            shutil.rmtree(staging, ignore_errors=True)
    if group.pg is not None:
        torch.distributed.barrier(group.pg)  # the export is whole when any rank returns
    return info


def load_hf(model: Any, sd_adapter: Any, path: str, group: Group) -> None:
    """Load the Hugging Face safetensors checkpoint at ``path`` into torchtitan's ``ModelWrapper``
    ``model``: read into ``sd_adapter.to_hf`` of its state (shards as they are), mapped back by
    ``from_hf``, as torchtitan's own manager does."""
    hf_state = sd_adapter.to_hf(model.state_dict())
    api.load(hf_state, path, process_group=group.pg)
    model.load_state_dict(sd_adapter.from_hf(hf_state))
