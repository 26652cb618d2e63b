"""Device and network catalog: peak FLOP/s, memory, bandwidths, and the achievable fractions of them.

Peak numbers are the vendors' dense (no sparsity) datasheet figures. Units: FLOP/s, bytes, bytes/s
(one direction, per device), seconds. Efficiency constants are physical and few, one per device
type and link type (see docs/planner.md, "Constants"):

- ``matmul_efficiency``: fraction of peak FLOP/s that training GEMMs reach on that device;
- ``memory_efficiency``: fraction of the HBM bandwidth that fused element-wise kernels reach;
- ``Network.efficiency``: NCCL bus bandwidth / link bandwidth (nccl-tests' "busbw").

Users add devices in TOML (``[[device]]`` and ``[network]`` tables, see :func:`load_hardware_file`);
``meshtrain plan --calibrate`` measures this machine and saves a ``cpu`` profile (:func:`load_profile`).
"""

from __future__ import annotations

import difflib
import tomllib
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshtrain.config import ConfigError

GiB = 2**30
DEFAULT_PROFILE = Path("~/.cache/meshtrain/hardware_profile.toml")
"""Where ``plan --calibrate`` saves this machine's profile and where ``--gpu cpu`` looks for it."""


@dataclass(frozen=True)
class Device:
    """One accelerator (or a CPU process). FLOP/s per dtype ("bfloat16", "float32"), bytes, bytes/s."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    matmul_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    framework_overhead_bytes: float = 3 * GiB
    """Memory the runtime takes before any tensor: CUDA context, NCCL buffers, allocator slack."""
    op_overhead_s: float = 0.0
    """Host time per launched operator that is *not* hidden (0 on GPUs, whose launches run ahead)."""
    matmul_table: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Measured GEMM FLOP/s by inner size k, per dtype (from ``--calibrate``); overrides the constant."""

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype``. Raises ConfigError for a dtype the device does not list."""
        if dtype not in self.peak_flops:
            raise ConfigError(f"device {self.name} has no peak for dtype {dtype!r}: "
                              f"valid are {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    def matmul_flops(self, dtype: str, k: int) -> float:
        """Achievable GEMM FLOP/s for inner dimension ``k``: measured table (log-interpolated) or peak*efficiency."""
        table = self.matmul_table.get(dtype)
        if not table:
            return self.peak(dtype) * self.matmul_efficiency
        sizes = [s for s, _ in table]
        i = bisect_left(sizes, k)
        if i == 0:
            return table[0][1] * min(1.0, k / sizes[0])
        if i == len(table):
            return table[-1][1]
        (k0, f0), (k1, f1) = table[i - 1], table[i]
        return f0 + (f1 - f0) * (k - k0) / (k1 - k0)

    def bandwidth(self) -> float:
        """Achievable memory bandwidth for element-wise kernels, bytes/s."""
        return self.memory_bandwidth * self.memory_efficiency


@dataclass(frozen=True)
class Network:
    """How devices talk. Bandwidths are per device, one direction, bytes/s; latencies in seconds."""

    devices_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    efficiency: float = 0.8

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """(achievable bandwidth bytes/s, latency s) of the slowest link a group uses."""
        if spans_nodes:
            return self.inter_node_bandwidth * self.efficiency, self.inter_node_latency_s
        return self.intra_node_bandwidth * self.efficiency, self.intra_node_latency_s


@dataclass(frozen=True)
class Hardware:
    """A device type and the network between many of them."""

    device: Device
    network: Network


TB = 1e12
_DGX_A100 = Network(8, 300e9, 25e9)   # NVLink3 600 GB/s bidirectional; 8x HDR 200 Gb/s per node
_DGX_H100 = Network(8, 450e9, 50e9)   # NVLink4 900 GB/s bidirectional; 8x NDR 400 Gb/s per node
_DGX_B200 = Network(8, 900e9, 50e9)   # NVLink5 1.8 TB/s bidirectional; 8x 400 Gb/s per node
_PCIE5 = Network(8, 64e9, 50e9)       # PCIe Gen5 x16 between cards; 400 Gb/s NIC per card
_MI300X = Network(8, 448e9, 50e9)     # Infinity Fabric, 7 links x 64 GB/s per GPU; 400 Gb/s NIC per GPU

# name: (bf16 FLOP/s, fp32 FLOP/s, memory bytes, HBM bytes/s, matmul_efficiency, network)
_CATALOG: dict[str, tuple[float, float, float, float, float, Network]] = {
    "A100-SXM-40GB": (312 * TB, 19.5 * TB, 40 * GiB, 1.555 * TB, 0.70, _DGX_A100),
    "A100-SXM-80GB": (312 * TB, 19.5 * TB, 80 * GiB, 2.039 * TB, 0.70, _DGX_A100),
    "H100-SXM-80GB": (989 * TB, 67 * TB, 80 * GiB, 3.35 * TB, 0.60, _DGX_H100),
    "H100-PCIe-80GB": (756 * TB, 51 * TB, 80 * GiB, 2.0 * TB, 0.60, _PCIE5),
    "H200-SXM-141GB": (989 * TB, 67 * TB, 141e9, 4.8 * TB, 0.60, _DGX_H100),
    "B200-SXM-180GB": (2250 * TB, 75 * TB, 180e9, 8.0 * TB, 0.60, _DGX_B200),
    "MI300X-192GB": (1307 * TB, 163 * TB, 192e9, 5.3 * TB, 0.45, _MI300X),
}
ALIASES = {"A100-40GB": "A100-SXM-40GB", "A100-80GB": "A100-SXM-80GB", "A100": "A100-SXM-80GB",
           "H100": "H100-SXM-80GB", "H100-SXM": "H100-SXM-80GB", "H100-PCIe": "H100-PCIe-80GB",
           "H200": "H200-SXM-141GB", "B200": "B200-SXM-180GB", "MI300X": "MI300X-192GB"}

# An uncalibrated CPU process: one core of a recent x86 server (AVX2/AVX-512 FMA), DDR4/5 share.
CPU_DEFAULT = Hardware(
    Device("cpu", {"float32": 50e9, "bfloat16": 25e9}, memory_bytes=16 * GiB, memory_bandwidth=10e9,
           matmul_efficiency=1.0, memory_efficiency=1.0, framework_overhead_bytes=350 * 2**20, op_overhead_s=10e-6),
    Network(devices_per_node=2, intra_node_bandwidth=2e9, inter_node_bandwidth=1e9,
            intra_node_latency_s=50e-6, inter_node_latency_s=100e-6, efficiency=1.0))


def catalog() -> dict[str, Hardware]:
    """Every built-in device type with its default node network (``cpu`` is the uncalibrated default)."""
    out = {name: Hardware(Device(name, {"bfloat16": bf16, "float32": fp32}, mem, bw, eff), net)
           for name, (bf16, fp32, mem, bw, eff, net) in _CATALOG.items()}
    out["cpu"] = CPU_DEFAULT
    return out


def get_hardware(name: str, hardware_file: Path | None = None, profile: Path | None = None,
                 devices_per_node: int | None = None) -> Hardware:
    """Resolve ``--gpu NAME``: built-ins, aliases, devices of ``hardware_file``, and ``cpu``.

    The calibrated profile at ``profile`` (default :data:`DEFAULT_PROFILE`), when it exists, replaces
    the default ``cpu`` (one thread per rank) and adds ``cpu-<n>threads`` (one rank using n threads).

    Raises:
        ConfigError: unknown name (with the closest valid one) or a bad hardware file.
    """
    known = catalog()
    path = (profile or DEFAULT_PROFILE).expanduser()
    if path.is_file():
        known.update(load_hardware_file(path))
    if hardware_file is not None:
        known.update(load_hardware_file(hardware_file))
    lookup = {k.lower(): k for k in known} | {k.lower(): v for k, v in ALIASES.items()}
    key = lookup.get(name.lower())
    if key is None:
        names = list(known) + list(ALIASES)
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.3)
        raise ConfigError(f"unknown device '{name}': {'did you mean ' + repr(close[0]) + '? ' if close else ''}"
                          f"valid are {', '.join(known)}")
    hw = known[key]
    if devices_per_node:
        hw = replace(hw, network=replace(hw.network, devices_per_node=devices_per_node))
    return hw


def _number(table: dict[str, Any], key: str, where: str) -> float:
    value = table.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}.{key} = {value!r} must be a positive number")
    return float(value)


def _device_from_table(t: dict[str, Any], where: str) -> Device:
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name must be a non-empty string")
    peaks = {"bfloat16": _number(t, "peak_bf16_flops", where), "float32": _number(t, "peak_fp32_flops", where)}
    kw = {k: _number(t, k, where) for k in ("matmul_efficiency", "memory_efficiency", "framework_overhead_bytes")
          if k in t}
    if "op_overhead_s" in t:
        kw["op_overhead_s"] = float(t["op_overhead_s"])
    table = {dtype: [(int(k), float(f)) for k, f in rows] for dtype, rows in t.get("matmul_table", {}).items()}
    return Device(name, peaks, _number(t, "memory_bytes", where), _number(t, "memory_bandwidth", where),
                  matmul_table=table, **kw)


def _network_from_table(t: dict[str, Any], where: str) -> Network:
    kw = {k: _number(t, k, where) for k in ("intra_node_latency_s", "inter_node_latency_s", "efficiency") if k in t}
    return Network(int(_number(t, "devices_per_node", where)), _number(t, "intra_node_bandwidth", where),
                   _number(t, "inter_node_bandwidth", where), **kw)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"hardware file '{path}' does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"hardware file '{path}' is not valid TOML: {e}") from None


def load_hardware_file(path: Path) -> dict[str, Hardware]:
    """Devices of a user file or of a calibrated profile: ``[[device]]`` tables (name, peak_bf16_flops, peak_fp32_flops, memory_bytes,
    memory_bandwidth, optional efficiencies) and one ``[network]`` table shared by them.

    Raises:
        ConfigError: missing file, bad TOML, or a missing/non-positive number (named).
    """
    data = _read_toml(path)
    if "network" not in data or "device" not in data:
        raise ConfigError(f"hardware file '{path}' needs [[device]] tables and a [network] table")
    net = _network_from_table(data["network"], "network")
    return {d.name: Hardware(d, net) for d in
            (_device_from_table(t, f"device[{i}]") for i, t in enumerate(data["device"]))}
