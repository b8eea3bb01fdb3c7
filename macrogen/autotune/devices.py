"""The accelerators ``macrogen plan`` plans for: a table of common GPUs, and device sets.

    kind("H100")                          -> H100 SXM 80GB (989 TFLOP/s bf16, 80 GB, NVLink 450 GB/s)
    parse_devices("8xH100:80GB,8xA100:40GB")
        -> DeviceSet(groups=((8, H100 SXM 80GB), (8, A100 SXM 40GB)))

Figures are the vendors' datasheet figures (dense: without 2:4 sparsity), each with
its source beside it. Link bandwidths are per GPU and per direction (a datasheet's
"900 GB/s NVLink" counts both directions). Latencies per ring step are NCCL's own cost
model's (``src/graph/tuning.cc``: ``hwLat`` for the Simple protocol's ring, ``baseLat``
per collective), which NCCL uses to choose its algorithms. A row can be overridden or
added from a JSON file (``load_table``). Pure: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from macrogen.autotune import units
from macrogen.autotune.layouts import MAX_WORLD

# NCCL src/graph/tuning.cc: ring/Simple latency per step (us) over NVLink, PCI and the network,
# and the fixed latency of a ring collective (baseLat)
NVLINK_STEP_S = 3.4e-6
PCI_STEP_S = 5.7e-6
NET_STEP_S = 9.6e-6
COLLECTIVE_S = 8.4e-6


@dataclass(frozen=True, eq=False)
class DeviceKind:
    """One accelerator model and the node it usually sits in."""

    name: str  # "H100 SXM 80GB"
    capability: str  # CUDA compute capability ("9.0")
    flops: dict[str, float]  # dense peak FLOP/s per dtype ("bf16", "fp16", "fp8", "tf32", "fp32")
    memory: float  # bytes of device memory
    hbm: float  # memory bandwidth, bytes/s
    intra: float  # bytes/s per GPU and direction to the GPUs of its node (NVLink, else PCIe)
    inter: float  # bytes/s per GPU and direction across nodes (the node's network)
    intra_step_s: float = NVLINK_STEP_S  # latency per ring step within the node
    inter_step_s: float = NET_STEP_S  # latency per ring step across nodes
    per_node: int = 8  # GPUs per node (sharing the fast link)
    # of the dtype's peak, what large matrix multiplies reach (cuBLAS on a GPU at its clocks;
    # the rest of a step, norms and element-wise work, is timed from memory traffic apart)
    matmul_efficiency: float = 0.75
    aliases: tuple[str, ...] = ()

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise KeyError(f"{self.name} has no {dtype} figure (has {', '.join(self.flops)})")
        return self.flops[dtype]

    def key(self) -> dict[str, Any]:
        """What a tuning record is keyed by: the device kind (name, capability, memory, link)."""
        return {
            "name": self.name,
            "capability": self.capability,
            "memory": int(self.memory),
            "link": int(self.intra),
        }


TB = 1e12
GB = 1e9

TABLE: tuple[DeviceKind, ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16/FP16 1,979 TFLOPS and FP8 3,958 with
    # sparsity (dense: half), TF32 989 with sparsity, FP32 67 TFLOPS; 80 GB HBM3 at 3.35 TB/s;
    # NVLink 900 GB/s (both directions). DGX H100 user guide: one 400 Gb/s ConnectX-7 per GPU.
    DeviceKind(
        "H100 SXM 80GB",
        "9.0",
        {"fp8": 1978.9e12, "bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 67e12},
        80 * GB,
        3.35 * TB,
        450 * GB,
        50 * GB,
        aliases=("H100", "H100-SXM", "H100SXM", "H100-80GB"),
    ),
    # H100 datasheet (PCIe): BF16 1,513 TFLOPS with sparsity, FP8 3,026, TF32 756, FP32 51;
    # 80 GB HBM2e at 2 TB/s; PCIe Gen5 128 GB/s (both directions) without an NVLink bridge.
    # A PCIe server's network is no standard: 100 Gb/s per GPU assumed (override with --link).
    DeviceKind(
        "H100 PCIe 80GB",
        "9.0",
        {"fp8": 1513e12, "bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51e12},
        80 * GB,
        2.0 * TB,
        64 * GB,
        12.5 * GB,
        intra_step_s=PCI_STEP_S,
        aliases=("H100-PCIE", "H100PCIE"),
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100 SXM's compute (BF16 1,979 TFLOPS
    # with sparsity); 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s; DGX H200: 400 Gb/s per GPU.
    DeviceKind(
        "H200 SXM 141GB",
        "9.0",
        {"fp8": 1978.9e12, "bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 67e12},
        141 * GB,
        4.8 * TB,
        450 * GB,
        50 * GB,
        aliases=("H200", "H200-SXM"),
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): BF16/FP16 312 TFLOPS (624 with sparsity),
    # TF32 156, FP32 19.5; 80 GB HBM2e at 2,039 GB/s, 40 GB HBM2 at 1,555 GB/s; NVLink 600 GB/s
    # (both directions). DGX A100 user guide: one 200 Gb/s HDR InfiniBand port per GPU.
    DeviceKind(
        "A100 SXM 80GB",
        "8.0",
        {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
        80 * GB,
        2.039 * TB,
        300 * GB,
        25 * GB,
        aliases=("A100", "A100-80GB", "A100-SXM", "A100-SXM-80GB"),
    ),
    DeviceKind(
        "A100 SXM 40GB",
        "8.0",
        {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
        40 * GB,
        1.555 * TB,
        300 * GB,
        25 * GB,
        aliases=("A100-40GB", "A100-SXM-40GB"),
    ),
    # A100 datasheet (PCIe 80GB): the SXM's compute, 1,935 GB/s; PCIe Gen4 64 GB/s (both
    # directions) without an NVLink bridge; network assumed as for the H100 PCIe.
    DeviceKind(
        "A100 PCIe 80GB",
        "8.0",
        {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
        80 * GB,
        1.935 * TB,
        32 * GB,
        12.5 * GB,
        intra_step_s=PCI_STEP_S,
        aliases=("A100-PCIE", "A100PCIE", "A100-PCIE-80GB"),
    ),
    # NVIDIA L40S datasheet: BF16/FP16 733 TFLOPS with sparsity (362 dense), FP8 1,466 with
    # sparsity, TF32 366 with sparsity, FP32 91.6; 48 GB GDDR6 at 864 GB/s; PCIe Gen4 x16
    # 64 GB/s (both directions), no NVLink; network assumed as for the H100 PCIe.
    DeviceKind(
        "L40S 48GB",
        "8.9",
        {"fp8": 733e12, "bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12},
        48 * GB,
        0.864 * TB,
        32 * GB,
        12.5 * GB,
        intra_step_s=PCI_STEP_S,
        aliases=("L40S",),
    ),
)


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().upper())


def kind(
    name: str, memory: float | None = None, table: tuple[DeviceKind, ...] = TABLE
) -> DeviceKind:
    """The table's row named ``name`` (its name or an alias, any case); with ``memory``, the row
    of that name with that much memory (``A100`` + 40 GB: the 40 GB A100), else the row with its
    memory replaced. KeyError naming the known kinds otherwise."""
    wanted = _norm(name)
    named = [k for k in table if wanted in {_norm(k.name), *(_norm(a) for a in k.aliases)}]
    # "A100" also names every A100 row (the first, exact, is the default): memory picks below
    named += [k for k in table if _norm(k.name).startswith(wanted + "-") and k not in named]
    if not named:
        known = ", ".join(k.name for k in table)
        raise KeyError(f"no device kind {name!r} in the table (known: {known})")
    if memory is None:
        return named[0]
    for k in named:
        if abs(k.memory - memory) <= 0.02 * k.memory:
            return k
    return replace(
        named[0], name=f"{named[0].name.rsplit(' ', 1)[0]} {memory / GB:g}GB", memory=memory
    )


@dataclass(frozen=True)
class DeviceSet:
    """The devices of a job, in rank order: groups of one kind each (``8xH100,8xA100``)."""

    groups: tuple[tuple[int, DeviceKind], ...]

    @property
    def world(self) -> int:
        return sum(n for n, _ in self.groups)

    @property
    def kinds(self) -> tuple[DeviceKind, ...]:
        found: dict[str, DeviceKind] = {}
        for _, k in self.groups:
            found.setdefault(k.name, k)
        return tuple(found.values())

    @property
    def uniform(self) -> bool:
        return len(self.kinds) == 1

    @property
    def per_node(self) -> int:
        return min(k.per_node for k in self.kinds)

    def describe(self) -> str:
        return ", ".join(f"{n} x {k.name}" for n, k in self.groups)


_GROUP = re.compile(r"\s*(?:(\d+)\s*[xX*]\s*)?([^:,]+?)\s*(?::\s*([^,]+?))?\s*")


def parse_devices(
    text: str, option: str = "--devices", table: tuple[DeviceKind, ...] = TABLE
) -> DeviceSet:
    """``8xH100:80GB,8xA100:40GB`` (COUNTxKIND[:MEMORY], in rank order); a bare KIND is one
    device. ``units.UsageError`` naming the option and the part for anything else."""
    groups: list[tuple[int, DeviceKind]] = []
    for part in text.split(","):
        m = _GROUP.fullmatch(part)
        if m is None or not m.group(2).strip():
            raise units.UsageError(
                f"{option} {part.strip()!r}: expected COUNTxKIND[:MEMORY] such as 8xH100:80GB"
            )
        count = units.count(option, m.group(1), maximum=MAX_WORLD) if m.group(1) else 1
        memory = units.size(option, m.group(3)) if m.group(3) else None
        try:
            groups.append((count, kind(m.group(2), memory, table)))
        except KeyError as e:
            raise units.UsageError(f"{option} {part.strip()!r}: {e.args[0]}") from None
    return DeviceSet(tuple(groups))


def load_table(path: Path, table: tuple[DeviceKind, ...] = TABLE) -> tuple[DeviceKind, ...]:
    """The table with the rows of a JSON file (a list of objects with ``DeviceKind``'s fields;
    sizes as numbers of bytes or text such as "80GB" and "450GB/s") replacing those of the same
    name or added. ValueError naming the file and the row for anything else."""
    from macrogen.autotune import database  # (its libcst only when a table is named)

    rows = database.read_json(path)
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of device kinds")
    out = list(table)
    for i, row in enumerate(rows):
        try:
            new = _row(row)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: device {i + 1}: {e}") from None
        out = [k for k in out if _norm(k.name) != _norm(new.name)] + [new]
    return tuple(out)


def _row(row: Any) -> DeviceKind:
    if not isinstance(row, dict):
        raise TypeError("a device kind is a JSON object")
    fields = dict(row)
    fields["flops"] = {
        str(k): _amount(v, units.number, "flops") for k, v in dict(fields["flops"]).items()
    }
    for name in ("memory",):
        fields[name] = _amount(fields[name], units.size, name)
    for name in ("hbm", "intra", "inter"):
        fields[name] = _amount(fields[name], units.bandwidth, name)
    fields["aliases"] = tuple(fields.get("aliases", ()))
    fields["capability"] = str(fields.get("capability", "?"))
    return DeviceKind(**fields)


def _amount(value: Any, read: Any, name: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    if isinstance(value, str):
        return float(read(name, value))
    raise ValueError(f"{name}: expected a positive number or text such as 80GB, not {value!r}")
