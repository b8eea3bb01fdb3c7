"""``macrogen checkpoint convert|list``: the checkpoints a resumable loop writes.

    macrogen checkpoint list ckpt                      every checkpoint folder and its state
    macrogen checkpoint convert ckpt model.pt --model-only
                                                       the newest complete one as a torch.save file

``convert`` takes a checkpoint folder (``ckpt/step_00000050``) or a directory of them
(its newest complete one). A DCP checkpoint already loads at any world size with
``resumable`` (DCP reshards); the converted file is for programs without
torch.distributed: ``model.load_state_dict(torch.load("model.pt"))``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "checkpoint",
        help="list or convert the checkpoints of a resumable loop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = actions.add_parser("convert", help="write a DCP checkpoint as one torch.save file")
    c.add_argument("src", metavar="SRC", help="a checkpoint folder, or a directory of them")
    c.add_argument("out", metavar="OUT", help="the torch.save file to write")
    c.add_argument("--model-only", action="store_true", help="write the model's state_dict alone")
    ls = actions.add_parser("list", help="list checkpoint folders and whether each is complete")
    ls.add_argument("dir", metavar="DIR", help="the resumable loop's dir")
    return p


def run(args: argparse.Namespace) -> int:
    # torch only when this command runs
    from macrogen.runtime import checkpoint_convert, checkpoint_dir

    if args.action == "list":
        return _list(Path(args.dir))
    try:
        used = checkpoint_convert.convert(args.src, args.out, model_only=args.model_only)
    except (checkpoint_dir.CheckpointError, OSError) as e:
        print(f"macrogen checkpoint: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} from {used}")
    return 0


def _list(root: Path) -> int:
    """Each checkpoint folder under ``root`` (or ``root`` itself, if it is one) and its state."""
    from macrogen.runtime import checkpoint_dir

    if not root.is_dir():
        print(f"macrogen checkpoint: error: not a directory: {root}", file=sys.stderr)
        return 1
    try:
        if checkpoint_dir.is_step_dir(root):
            folders = [root]
        else:
            folders = checkpoint_dir.step_dirs(root)
    except OSError as e:
        print(f"macrogen checkpoint: error: can't list {root}: {e.strerror or e}", file=sys.stderr)
        return 1
    if not folders:
        print(f"{root}: no checkpoint folders (step_NNNNNNNN) in it")
    for path in folders:
        state, why = checkpoint_dir.examine(path, deep=True)
        label = {checkpoint_dir.COMPLETE: "complete", checkpoint_dir.PARTIAL: "INCOMPLETE: "}.get(
            state, "UNUSABLE: "
        )
        print(f"{path}  {label}{why if state != checkpoint_dir.COMPLETE else ''}")
    return 0
