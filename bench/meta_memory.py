"""Peak memory per rank of building and loading a model that is larger than one rank's share.

    .venv/bin/python bench/meta_memory.py [--scale 4] [--ranks 4]

A Llama (``--scale 4``: 36 M fp32 parameters, 144 MB; its AdamW state twice that again) is
saved with ``save_pretrained``, then, on 4 gloo ranks, either built on the meta device and
given its shards with ``mg.parallelize(model, dp="fsdp", init=mg.load(folder))`` (or cut into
2 pipeline stages first, ``pp=2, dp="fsdp"``: each rank a half of its stage), or built with
its values on every rank and sharded (``mg.parallelize(model, dp="fsdp")``, the way without
``init=``). Each rank's peak RSS over the build and load (``/proc/self/status`` VmHWM, reset
before, minus the RSS before) is printed beside its share of the parameters and the largest
layer; the ratio column divides by (share + largest layer), which the meta build must keep
under 1.3.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    from tests import meta_models
    from tests.distributed import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        folder = meta_models.save_memory_folder(Path(directory), args.scale)
        code = meta_models.expanded(Path(directory))
        print("| build | ranks | model MB | share MB | largest layer MB | peak RSS MB (max over"
              " ranks) | peak / (share + layer) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        names = {"meta": "meta + init=mg.load", "meta_pp": "meta + init=mg.load, pp=2",
                 "built": "built on every rank"}  # fmt: skip
        for how in names:
            rows = run_ranks(meta_models.measure_memory, args.ranks,
                             args=(code, folder, args.scale, how), timeout=600)  # fmt: skip
            peak = max(r["peak"] for r in rows)
            r = rows[0]
            bound = r["share"] + r["largest"]
            print(f"| {names[how]} | {args.ranks} | {r['total'] / MB:.0f} | {r['share'] / MB:.0f} |"
                  f" {r['largest'] / MB:.0f} | {peak / MB:.0f} | {peak / bound:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
