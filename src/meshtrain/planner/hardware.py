"""Device and network catalog: peak FLOP/s, memory, bandwidths, and the achievable fractions of them.

Peak numbers are the vendors' dense (no sparsity) datasheet figures. Units: FLOP/s, bytes, bytes/s
(one direction, per device), seconds. Efficiency constants are physical and few, one per device
type and link type (see docs/planner.md, "Constants"):

- ``matmul_efficiency``: fraction of peak FLOP/s that large training GEMMs reach on that device (the
  compute term of a GEMM; each GEMM also pays its operand traffic, ``cost.gemm_traffic_bytes``);
- ``memory_efficiency``: fraction of the HBM bandwidth that fused element-wise kernels reach;
- ``flash2_efficiency``: fraction of peak FLOP/s that FlashAttention-2 reaches where it falls below the GEMM rate
  (Hopper, :data:`FLASH2_HOPPER`); elsewhere fused attention runs at the GEMM rate;
- ``Network.intra_node_efficiency`` / ``inter_node_efficiency``: NCCL bus bandwidth / link bandwidth
  (nccl-tests' "busbw": about 0.8 on NVLink, 0.9 on InfiniBand).

Users add devices in TOML (``[[device]]`` and ``[network]`` tables, see :func:`load_hardware_file`);
``meshtrain plan --calibrate`` measures this machine and saves ``cpu`` profiles in the same format
(:data:`DEFAULT_PROFILE`).
"""

from __future__ import annotations

import difflib
import functools
import os
import tomllib
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError

GiB = 2**30
DEFAULT_PROFILE = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "meshtrain" / "hardware_profile.toml"
"""Where ``plan --calibrate`` saves this machine's profile and where ``--gpu cpu`` looks for it:
``$XDG_CACHE_HOME/meshtrain/hardware_profile.toml``, ``~/.cache/meshtrain/hardware_profile.toml`` when
``XDG_CACHE_HOME`` is unset or empty (the XDG Base Directory Specification's user cache folder)."""


GROUPED_GEMM_TILE_ROWS = 128
"""M-height of a grouped GEMM's tile on Hopper-class GPUs: each expert's rows run in ``ceil(rows / 128)`` whole tiles,
the last one partly idle (tile quantization, NVIDIA's "Matrix Multiplication Background" user guide). 128 is the tile
M of ``torch._grouped_mm`` on sm90 (pytorch ``aten/src/ATen/native/cuda/GroupMM.cu``,
``dispatch_bf16_grouped_kernel_on_tile_size``: CUTLASS tiles of 128 x 256 x 64 unless the mean rows per group or N
are <= 128, then 64 x 128 x 128) and the row alignment DeepGEMM's grouped GEMM requires of every expert's segment
(deepseek-ai/DeepGEMM, ``get_m_alignment_for_contiguous_layout()`` = 128); DeepGEMM issue #211 states the resulting
"M-occupancy" ``(M / B_M) / ceil(M / B_M)`` per expert.
Used by :func:`meshtrain.planner.cost.grouped_gemm_padding_rows`."""


@dataclass(frozen=True)
class Device:
    """One accelerator (or a CPU process). FLOP/s per dtype ("bfloat16", "float32"), bytes, bytes/s."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float
    matmul_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    flash2_efficiency: float | None = None
    """Fraction of peak FLOP/s that FlashAttention-2 (forward + backward) reaches on this device when that is below
    the GEMM rate, for stacks whose attention kernel is FlashAttention-2 (``Framework.attention = "flash2"``); None:
    it runs at the GEMM rate (on the A100, FlashAttention-2 reaches 50-73% of peak, Dao 2023, arXiv 2307.08691,
    abstract: the GEMMs' rate)."""
    framework_overhead_bytes: float = 3 * GiB
    """Memory the runtime takes before any tensor: CUDA context, NCCL buffers, allocator slack."""
    validated: bool = True
    """Whether a published run on this device type was ever predicted (``planner/data/published_runs.toml``,
    :func:`validated_devices`); False for a catalog device that never was (B200, MI300X, ...): ``meshtrain plan``
    says "unvalidated" and widens its memory range (:func:`meshtrain.planner.memory.memory_range`)."""
    layer_host_s: float = 0.0
    """Host time per layer and micro-step (forward + backward operator dispatch, autograd) that is not
    hidden behind kernels: measured on CPU, 0 on GPUs, whose host runs ahead of the kernels."""
    microstep_host_s: float = 0.0
    """Host time per micro-step outside the layers (embeddings, head, loss, the training loop)."""
    tensor_update_host_s: float = 0.0
    """Host time of the optimizer step (AdamW, gradient-norm clipping) per parameter tensor."""
    sharded_tensor_update_host_s: float = 0.0
    """The same for a parameter sharded by FSDP2 (a DTensor: every operator goes through its dispatch)."""
    fsdp_unit_overhead_s: float = 0.0
    """Host time FSDP spends per unit collective beyond the transfer (copy-in/out, hooks, DTensor
    dispatch) that is not hidden: measured on CPU, 0 on GPUs whose host runs ahead of the kernels."""
    tp_layer_host_s: float = 0.0
    """Host time per layer and micro-step that tensor parallelism adds beyond its collectives (DTensor's
    dispatch of every sharded operator): measured on CPU, 0 on GPUs, whose host runs ahead of the kernels."""
    tp_seqpar_layer_host_s: float = 0.0
    """The same with Megatron sequence parallelism."""
    ulysses_layer_host_s: float = 0.0
    """The same for Ulysses sequence parallelism (its all-to-all autograd functions)."""
    ring_layer_host_s: float = 0.0
    """The same for ring attention (its blockwise loop, forward and backward)."""
    pipeline_action_host_s: float = 0.0
    """Host time per pipeline action (one micro-batch's forward, backward, or zero-bubble half of a
    backward through one chunk) that ``torch.distributed.pipelining``'s schedule adds beyond the chunk's
    own work and its transfer (bookkeeping, issuing and completing the p2p, the loss call): measured on
    CPU, 0 on GPUs, whose host runs ahead of the kernels."""
    split_backward_factor: float = 1.0
    """Time of a backward run as two autograd passes (input gradients, then weight gradients: the
    zero-bubble schedules' I and W) over one fused backward: measured on CPU (a GPT block at width 128),
    1 on GPUs (no published measurement)."""
    ddp_bucket_overhead_s: float = 0.0
    """Time DDP's gradient all-reduce costs per bucket beyond the transfer when it is issued from
    inside backward (hooks, bucket copies, and on CPU gloo's thread taking the core from backward):
    measured on CPU, 0 on GPUs."""
    comm_overlap: bool = True
    """Whether collectives can run during compute (GPUs: copy engines / NCCL kernels beside the GEMMs;
    a CPU rank's gloo thread competes with its own compute for the same core, so no)."""
    overlap_slowdown: float = 0.189
    """How much longer compute takes while a collective runs beside it (the collective's kernels take SMs and
    memory bandwidth from the GEMMs): 0.189, the mean computational slowdown Lee et al. 2025 measured overlapping
    compute and communication in GPT and Llama training on A100s, H100s, MI250s and MI210s (arXiv 2507.03114,
    abstract and Sec. 5: mean 18.9%, at most 40%). A collective of ``c`` seconds hidden behind compute so costs
    ``c * overlap_slowdown / (1 + overlap_slowdown)`` (:func:`meshtrain.planner.cost.overlapped`)."""
    grouped_gemm_tile: int = GROUPED_GEMM_TILE_ROWS
    """Rows of a grouped GEMM's output tile (:data:`GROUPED_GEMM_TILE_ROWS`, where its source is); 0: no tiles (an
    ideal device, or one whose grouped GEMM pads nothing)."""
    matmul_table: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Measured FLOP/s of a Linear forward + backward by inner size k, per dtype (``--calibrate``);
    overrides ``peak * matmul_efficiency``."""
    attention_table: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Measured FLOP/s (causal FLOPs executed) of fused attention forward + backward by sequence length,
    per dtype (``--calibrate``); without it attention runs at the GEMM rate."""
    peak_source: str = "datasheet"
    """Where ``peak_flops`` comes from: "datasheet" (the vendor's dense figure), "measured matmul" (a
    calibrated CPU profile: this machine's fastest GEMM, which a step's own GEMMs nearly reach, so MFU
    against it reads high, ~90% for the main job) or "assumed" (the uncalibrated ``cpu`` guess)."""

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype``. Raises ConfigError for a dtype the device does not list."""
        if dtype not in self.peak_flops:
            raise ConfigError(f"device {self.name} has no peak for dtype {dtype!r}: "
                              f"valid are {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    def mfu_label(self) -> str:
        """"MFU" against a datasheet peak, else the peak it is measured against: "MFU (vs measured matmul peak)"."""
        return "MFU" if self.peak_source == "datasheet" else f"MFU (vs {self.peak_source} peak)"

    def matmul_flops(self, dtype: str, k: int) -> float:
        """Achievable GEMM FLOP/s for inner dimension ``k``: measured table (interpolated) or peak*efficiency."""
        table = self.matmul_table.get(dtype)
        return _interpolate(table, k) if table else self.peak(dtype) * self.matmul_efficiency

    def attention_flops(self, dtype: str, seq_len: int, k: int, kernel: str = "flash") -> float:
        """Achievable FLOP/s of fused attention at ``seq_len``: the measured table, else the GEMM rate at ``k``;
        for ``kernel = "flash2"`` (FlashAttention-2) at most ``peak * flash2_efficiency`` where the device lists one;
        for ``"flash-triton"`` (FlashAttention in Triton) FlashAttention-2's rate / :data:`FLASH_TRITON_SLOWDOWN`."""
        table = self.attention_table.get(dtype)
        if table:
            return _interpolate(table, seq_len)
        rate = self.matmul_flops(dtype, k)
        if kernel in ("flash2", "flash-triton") and self.flash2_efficiency is not None:
            rate = min(rate, self.peak(dtype) * self.flash2_efficiency)
        return rate / FLASH_TRITON_SLOWDOWN if kernel == "flash-triton" else rate

    def bandwidth(self) -> float:
        """Achievable memory bandwidth for element-wise kernels, bytes/s."""
        return self.memory_bandwidth * self.memory_efficiency

    def gemm_traffic_seconds(self, dtype: str, nbytes: float) -> float:
        """Seconds a GEMM's ``nbytes`` of operand and result traffic add to its FLOP time (the no-overlap
        roofline of :func:`meshtrain.planner.cost.gemm_traffic_bytes`): ``nbytes / bandwidth()``; 0 with a
        measured ``matmul_table`` for ``dtype``, whose rates already include it."""
        return 0.0 if self.matmul_table.get(dtype) else nbytes / self.bandwidth()

    def grouped_gemm_tile_rows(self, dtype: str) -> int:
        """Rows of one output tile of a grouped GEMM (one expert's rows are run in whole tiles of this many):
        ``grouped_gemm_tile`` (:data:`GROUPED_GEMM_TILE_ROWS` on a GPU); 0 (no padding charged) with a measured
        ``matmul_table`` for ``dtype``, a CPU profile, whose grouped GEMM loops over the experts' matrices without tiles
        of fixed height."""
        return 0 if self.matmul_table.get(dtype) else self.grouped_gemm_tile


def _interpolate(table: list[tuple[int, float]], x: int) -> float:
    """Linear interpolation in a table sorted by size; below the first size it scales down
    proportionally (fixed costs dominate), above the last it stays flat."""
    sizes = [s for s, _ in table]
    i = bisect_left(sizes, x)
    if i == 0:
        return table[0][1] * min(1.0, x / sizes[0])
    if i == len(table):
        return table[-1][1]
    (x0, f0), (x1, f1) = table[i - 1], table[i]
    return f0 + (f1 - f0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Network:
    """How devices talk. Bandwidths are one direction, bytes/s (``inter_node_bandwidth`` per NIC, one NIC
    per device unless ``nics_per_node`` says fewer); latencies in seconds."""

    devices_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    intra_node_efficiency: float = 0.8
    inter_node_efficiency: float = 0.9
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Measured (bandwidth, latency per ring step) of each collective inside a node (``--calibrate``);
    overrides the link's numbers for that kind."""
    nics_per_node: int = 0
    """NICs a node's devices share; 0 = one per device (GPU servers). A CPU or Ethernet cluster often has
    one: then a ring crossing nodes gets one NIC however many ranks a node has."""

    def link(self, spans_nodes: bool, kind: str | None = None, ranks_per_node: int = 1) -> tuple[float, float]:
        """(achievable bandwidth bytes/s, latency s) of the slowest link a group uses (for ``kind``).

        A ring collective (all-reduce, all-gather, reduce-scatter) of a group with g ranks on each node
        crosses nodes at ``min(intra, g * inter)``: NCCL runs one ring per NIC (its channels), each ring
        carrying 1/g of the buffer through one NIC and through every GPU's intra-node link, so the g NICs
        of the group's ranks work in parallel (nccl-tests: the bus bandwidth of a multi-node all-reduce
        on DGX A100 / H100 is about the node's NIC total, 8 x 25 / 8 x 50 GB/s, not one NIC's). All-to-all
        and p2p send each rank's own data through its own NIC: ``inter``. The cost model passes g for
        data-parallel rings only (tp's reason: ``cost.micro_batch``). Takeaway: data parallelism over
        whole nodes (tp = 1) reduces gradients ~8x faster than one NIC per rank would suggest. With
        ``nics_per_node`` = n NICs per node a ring uses ``min(g, n)`` of them.
        """
        if not spans_nodes and kind in self.collectives:
            return self.collectives[kind]
        intra = self.intra_node_bandwidth * self.intra_node_efficiency
        if spans_nodes:
            inter = self.inter_node_bandwidth * self.inter_node_efficiency
            if kind in RING_KINDS:
                nics = max(1, ranks_per_node) if not self.nics_per_node else min(max(1, ranks_per_node),
                                                                                   self.nics_per_node)
                inter = min(intra, nics * inter)
            return inter, self.inter_node_latency_s
        return intra, self.intra_node_latency_s


RING_KINDS = ("all-reduce", "all-gather", "reduce-scatter")
"""Collectives NCCL runs as rings over every channel (and so over every NIC of the group's ranks)."""


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
    "A100-SXM-40GB": (312 * TB, 19.5 * TB, 40 * GiB, 1.555 * TB, 0.72, _DGX_A100),
    "A100-SXM-80GB": (312 * TB, 19.5 * TB, 80 * GiB, 2.039 * TB, 0.72, _DGX_A100),
    "H100-SXM-80GB": (989 * TB, 67 * TB, 80 * GiB, 3.35 * TB, 0.56, _DGX_H100),
    "H100-PCIe-80GB": (756 * TB, 51 * TB, 80 * GiB, 2.0 * TB, 0.56, _PCIE5),
    "H200-SXM-141GB": (989 * TB, 67 * TB, 141e9, 4.8 * TB, 0.56, _DGX_H100),
    # Meta's Grand Teton H100 (torchtitan docs/performance.md): 96 GB HBM2e at 2.4 TB/s, 500 W power limit,
    # 400 Gb/s RDMA per GPU. Its real peak is "between SXM and NVL" (torchtitan); the SXM datasheet's here.
    "H100-HBM2e-96GB": (989 * TB, 67 * TB, 95 * GiB, 2.4 * TB, 0.56, _DGX_H100),
    "B200-SXM-180GB": (2250 * TB, 75 * TB, 180e9, 8.0 * TB, 0.56, _DGX_B200),
    "MI300X-192GB": (1307 * TB, 163 * TB, 192e9, 5.3 * TB, 0.35, _MI300X),
}
FLASH2_HOPPER = 0.35
"""FlashAttention-2 on Hopper: "FlashAttention-2 achieving only 35% utilization on the H100 GPU" (Shah et al. 2024,
"FlashAttention-3", arXiv 2407.08608, abstract), where GEMMs and FlashAttention-3 reach 75% (same). PyTorch's SDPA
ran this kernel on the H100 until cuDNN attention became its default there (cuDNN SDPA was opt-in after torch 2.5,
pytorch/pytorch#138522; #142132 measures SDPA at 329 TFLOP/s against cuDNN's 631 on an H100, 2024-12)."""
FLASH_TRITON_SLOWDOWN = 1.8
"""FlashAttention in Triton (``flash_attn_triton``, MPT's ``attn_impl: triton``) against FlashAttention-2: "around
1.3-1.5x faster than FlashAttention in Triton in the forward pass and around 2x faster in the backward pass" (Dao 2023,
arXiv 2307.08691, Sec. 4.1, A100): (1.4 + 2 * 2) / 3 with backward twice the forward's FLOPs."""
HOPPER = ("H100-SXM-80GB", "H100-PCIe-80GB", "H200-SXM-141GB", "H100-HBM2e-96GB")
EFFICIENCY_FROM = {"A100-SXM-40GB": "A100-SXM-80GB", "H100-PCIe-80GB": "H100-SXM-80GB",
                   "H200-SXM-141GB": "H100-SXM-80GB", "H100-HBM2e-96GB": "H100-SXM-80GB"}
"""Device types that reuse another's ``matmul_efficiency`` (the same chip): one fit moves them together
(:func:`meshtrain.planner.validate.fit_matmul_efficiency` fits per group, docs/planner.md "Constants")."""
ALIASES = {"A100-40GB": "A100-SXM-40GB", "A100-80GB": "A100-SXM-80GB", "A100": "A100-SXM-80GB",
           "H100": "H100-SXM-80GB", "H100-SXM": "H100-SXM-80GB", "H100-PCIe": "H100-PCIe-80GB",
           "H200": "H200-SXM-141GB", "B200": "B200-SXM-180GB", "MI300X": "MI300X-192GB"}

CPU_REFERENCE = Path(__file__).parent / "data" / "cpu_reference.toml"
"""The uncalibrated ``cpu`` and ``cpu-2threads``: what ``meshtrain plan --calibrate`` measured on one reference machine
(a 2-core x86-64 VM with AVX512-BF16, torch 2.13, gloo over loopback; the file's header says more), with its memory
left at a 16 GiB placeholder and ``peak_source = "assumed"`` (no error range). Measured host times and gloo numbers
of one machine carry to another far better than guesses do; its compute is what ``--calibrate-from`` rescales
(docs/planner.md, "Plan vs actual on this machine")."""
_CPU_REFERENCE: dict[str, Hardware] = {}


def cpu_reference() -> dict[str, Hardware]:
    """The devices of :data:`CPU_REFERENCE` by name (read once)."""
    if not _CPU_REFERENCE:
        _CPU_REFERENCE.update(load_hardware_file(CPU_REFERENCE))
    return _CPU_REFERENCE


PUBLISHED_RUNS = Path(__file__).parent / "data" / "published_runs.toml"
"""Measured runs from papers and framework tables (``meshtrain plan --validate``'s default file)."""


@functools.lru_cache(maxsize=1)
def validated_devices() -> frozenset[str]:
    """The catalog's device types that at least one run of :data:`PUBLISHED_RUNS` ran on (its ``gpu``, aliases
    resolved): the devices whose constants (``matmul_efficiency``, the memory model's range) were checked against a
    measurement. A device that shares another's fitted efficiency (:data:`EFFICIENCY_FROM`) but has no run of its own
    is not among them."""
    with PUBLISHED_RUNS.open("rb") as f:
        runs = tomllib.load(f).get("run", [])
    names = {str(r.get("gpu", "")) for r in runs}
    return frozenset(ALIASES.get(n, n) for n in names if ALIASES.get(n, n) in _CATALOG)


def catalog() -> dict[str, Hardware]:
    """Every built-in device type with its default node network (``cpu`` and ``cpu-2threads``: the uncalibrated
    reference, :func:`cpu_reference`); a GPU without a published run is marked ``validated = False``."""
    checked = validated_devices()
    out = {name: Hardware(Device(name, {"bfloat16": bf16, "float32": fp32, **_fp8_peak(name)}, mem, bw, eff,
                                 flash2_efficiency=FLASH2_HOPPER if name in HOPPER else None,
                                 validated=name in checked), net)
           for name, (bf16, fp32, mem, bw, eff, net) in _CATALOG.items()}
    out.update(cpu_reference())
    return out


def _fp8_peak(name: str) -> dict[str, float]:
    """``{"float8": dense FP8 FLOP/s}`` of a catalog device that has FP8 tensor cores (:data:`FP8_PEAKS`), else {}."""
    return {"float8": FP8_PEAKS[name]} if name in FP8_PEAKS else {}


def get_hardware(name: str, hardware_file: Path | None = None, profile: Path | None = None,
                 devices_per_node: int | None = None, nics_per_node: int | None = None) -> Hardware:
    """Resolve ``--gpu NAME``: built-ins, aliases, devices of ``hardware_file``, and ``cpu``.

    The calibrated profile at ``profile`` (default :data:`DEFAULT_PROFILE`), when it exists, replaces
    the default ``cpu`` (one thread per rank) and adds ``cpu-<n>threads`` (one rank using n threads).
    ``devices_per_node`` and ``nics_per_node`` override the network's.

    Raises:
        ConfigError: unknown name (with the closest valid one) or a bad hardware file.
    """
    for flag, value in (("--devices-per-node", devices_per_node), ("--nics-per-node", nics_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} = {value} must be >= 1")
    known = catalog()
    path = (profile or DEFAULT_PROFILE).expanduser()
    if os.path.lexists(path):  # a calibrated profile: its peaks are this machine's fastest measured GEMM
        known.update({k: replace(h, device=replace(h.device, peak_source="measured matmul"))
                      for k, h in load_hardware_file(path, PROFILE).items()})
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
    if nics_per_node:
        hw = replace(hw, network=replace(hw.network, nics_per_node=nics_per_node))
    return hw


HOST_KEYS = ("layer_host_s", "microstep_host_s", "tensor_update_host_s", "sharded_tensor_update_host_s",
             "fsdp_unit_overhead_s", "ddp_bucket_overhead_s", "tp_layer_host_s", "tp_seqpar_layer_host_s",
             "ulysses_layer_host_s", "ring_layer_host_s", "pipeline_action_host_s", "split_backward_factor")


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
    kw = {k: _number(t, k, where) for k in ("matmul_efficiency", "memory_efficiency", "flash2_efficiency",
                                            "framework_overhead_bytes") if k in t}
    for key in HOST_KEYS:
        if key in t:
            kw[key] = float(t[key])
    if "comm_overlap" in t:
        kw["comm_overlap"] = bool(t["comm_overlap"])
    if "overlap_slowdown" in t:
        value = t["overlap_slowdown"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}.overlap_slowdown = {value!r} must be a number >= 0 (0: hidden collectives "
                              f"cost nothing)")
        kw["overlap_slowdown"] = float(value)
    if "peak_source" in t:
        kw["peak_source"] = str(t["peak_source"])
    for key in ("matmul_table", "attention_table"):
        kw[key] = {dtype: [(int(k), float(f)) for k, f in rows] for dtype, rows in t.get(key, {}).items()}
    return Device(name, peaks, _number(t, "memory_bytes", where), _number(t, "memory_bandwidth", where), **kw)


def _network_from_table(t: dict[str, Any], where: str) -> Network:
    keys = ("intra_node_latency_s", "inter_node_latency_s", "intra_node_efficiency", "inter_node_efficiency")
    kw: dict[str, Any] = {k: _number(t, k, where) for k in keys if k in t}
    kw["collectives"] = {kind: (float(b), float(a)) for kind, (b, a) in t.get("collectives", {}).items()}
    if "nics_per_node" in t:
        kw["nics_per_node"] = int(_number(t, "nics_per_node", where))
    return Network(int(_number(t, "devices_per_node", where)), _number(t, "intra_node_bandwidth", where),
                   _number(t, "inter_node_bandwidth", where), **kw)


NETWORK_KEYS = ("devices_per_node", "intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency_s",
                "inter_node_latency_s", "intra_node_efficiency", "inter_node_efficiency", "nics_per_node")
"""The numbers of a ``[network]`` table (:class:`Network`), each a positive number."""


def network_with(net: Network, table: dict[str, Any], where: str) -> Network:
    """``net`` with the numbers ``table`` gives (a part of a ``[network]`` table: any of :data:`NETWORK_KEYS`), the
    cluster a published run ran on where it is not the catalog's (e.g. 400 Gbit/s per node instead of a NIC per GPU).

    Raises:
        ConfigError: an unknown key, or a value that is not a positive number (named with ``where``)."""
    unknown = sorted(set(table) - set(NETWORK_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(NETWORK_KEYS)}")
    kw: dict[str, Any] = {k: _number(table, k, where) for k in table}
    for key in ("devices_per_node", "nics_per_node"):
        if key in kw:
            kw[key] = int(kw[key])
    return replace(net, **kw)


PROFILE = "hardware profile"
"""What a calibrated profile is called in errors (:func:`load_hardware_file`'s ``what``)."""
PROFILE_FIX = ("write it again with meshtrain plan --calibrate [--profile FILE], or remove it (without a profile the "
               "planner takes the reference machine's)")
"""What to do about a damaged profile (:func:`meshtrain.fileio.read_checked`'s ``fix``)."""


def load_hardware_file(path: Path, what: str = "hardware file") -> dict[str, Hardware]:
    """Devices of a user file or of a calibrated profile.

    Format: ``[[device]]`` tables (name, peak_bf16_flops, peak_fp32_flops, memory_bytes, memory_bandwidth,
    optional matmul_efficiency, memory_efficiency, flash2_efficiency, framework_overhead_bytes, the host times of
    :data:`HOST_KEYS`, comm_overlap, peak_source,
    matmul_table, attention_table)
    and one ``[network]`` table shared by them (devices_per_node, intra_node_bandwidth,
    inter_node_bandwidth, optional latencies, efficiencies and measured ``collectives``).

    ``what`` names the file in errors: a ``--hardware`` file, or the calibrated :data:`PROFILE`.

    Raises:
        ConfigError: missing file, not a regular file of a record's size (:func:`meshtrain.fileio.read_checked`),
            empty or bad TOML, or a missing/non-positive number (named).
    """
    import tomllib

    from meshtrain.fileio import read_text_checked

    fix = PROFILE_FIX if what == PROFILE else "give a TOML file with [[device]] tables and a [network] table"
    text = read_text_checked(path, what, fix)
    if not text.strip():
        raise ConfigError(f"{what} '{path}' is empty: {fix}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not valid TOML ({e}): {fix}") from None
    if "network" not in data or "device" not in data:
        raise ConfigError(f"{what} '{path}' needs [[device]] tables and a [network] table")
    net = _network_from_table(data["network"], "network")
    return {d.name: Hardware(d, net) for d in
            (_device_from_table(t, f"device[{i}]") for i, t in enumerate(data["device"]))}


# H800 SXM (the export H100: the same Hopper die, FLOP/s and HBM3, NVLink cut to 400 GB/s bidirectional; DeepSeek-V3
# trained on 2,048 of them, 8 per node with an 8 x 400 Gb/s InfiniBand NIC per GPU: V3 report, arXiv:2412.19437,
# Sec. 3.1). Its matmul efficiency is the H100's (the same chip).
_DGX_H800 = Network(8, 200e9, 50e9)   # NVLink 400 GB/s bidirectional; 8x NDR 400 Gb/s per node
_CATALOG["H800-SXM-80GB"] = (989 * TB, 67 * TB, 80 * GiB, 3.35 * TB, 0.56, _DGX_H800)
HOPPER = (*HOPPER, "H800-SXM-80GB")
EFFICIENCY_FROM["H800-SXM-80GB"] = "H100-SXM-80GB"
ALIASES["H800"] = "H800-SXM-80GB"

FP8_PEAKS = {"H100-SXM-80GB": 1979 * TB, "H100-PCIe-80GB": 1513 * TB, "H200-SXM-141GB": 1979 * TB,
             "H100-HBM2e-96GB": 1979 * TB, "H800-SXM-80GB": 1979 * TB}
"""Dense FP8 tensor-core FLOP/s (half the datasheets' "with sparsity" figures): NVIDIA H100 datasheet (SXM 3,958 and
PCIe 3,026 TFLOP/s with sparsity), H200 datasheet (3,958), H800 SXM datasheet (3,958, the H100 SXM's die): 2x the bf16
peak. The FP8 GEMMs of ``Framework.fp8`` run at ``FP8_PEAKS * matmul_efficiency`` (the bf16 fit's efficiency, assumed
the same: no published FP8 run fits it). Devices without FP8 tensor cores (A100) or not validated here have none."""
