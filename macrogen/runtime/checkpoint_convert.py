"""``macrogen checkpoint convert``: a DCP checkpoint as one ``torch.save`` file.

The folder is checked as a load checks it (complete, intact, the user's own
files) and read with the restricted reader of ``checkpoint_files``, without a
process group; the file is written beside its destination and renamed.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from macrogen import files
from macrogen.runtime.checkpoint_dir import COMPLETE, CheckpointError, examine, is_step_dir, latest
from macrogen.runtime.checkpoint_files import (
    SafeEmptyLoadPlanner,
    SafeReader,
    Unusable,
    one_line,
    read_metadata,
    root_error,
)


def convert(src: str | os.PathLike[str], out: str | os.PathLike[str], *, model_only: bool) -> Path:
    """Write a DCP checkpoint as one ``torch.save`` file, for loading without torch.distributed.

    ``src`` is a checkpoint folder (``ckpt/step_00000050``) or a directory of them (its
    newest complete one). The file holds ``{"model", "optim", "loop", "rng"}`` as the
    checkpoint has them (``optim``: flattened per parameter, torch's layout that
    ``set_optimizer_state_dict`` loads), or with ``model_only`` the model's state_dict alone
    (``model.load_state_dict(torch.load(out))``). ``out`` is replaced whole or not at
    all (written beside it, then renamed). Returns the folder converted.
    """
    path = Path(src)
    if not is_step_dir(path):
        why = root_error(path)
        if why is not None:
            raise CheckpointError(f"refusing to read checkpoints under {str(path)!r}: {why}")
        found = latest(path)
        if found is None:
            raise CheckpointError(f"no complete checkpoint under {str(path)!r}")
        path = found
    state, why = examine(path)
    if state != COMPLETE:
        raise CheckpointError(f"checkpoint {str(path)!r} is not complete: {why}")
    whole: dict[str, Any] = {}
    try:
        metadata = read_metadata(path)
    except (Unusable, OSError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} can't be read: {one_line(e)}") from None
    try:  # as dcp_to_torch_save reads it (dcp.load would fill a copy), byte items weights_only
        _load_state_dict(
            whole,
            storage_reader=SafeReader(path, metadata),
            planner=SafeEmptyLoadPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except (Exception, CheckpointException) as e:  # the files are data from disk: any failure
        raise CheckpointError(f"checkpoint {str(path)!r} can't be read: {one_line(e)}") from None
    if model_only and not isinstance(whole.get("model"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r} holds no model")
    _save_atomic(whole["model"] if model_only else whole, Path(out))
    return path


def _save_atomic(obj: Any, out: Path) -> None:
    """torch.save ``obj`` to ``out``: readers see the old file or the new, never half of one."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        files.write_atomic(out, buffer.getvalue())  # staged beside OUT, renamed
    except files.WriteError as e:  # a directory, a read-only file: it says so itself
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"can't write {out}: {e.strerror or e}") from None
