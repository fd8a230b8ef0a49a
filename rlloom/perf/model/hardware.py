"""Device descriptions: peak rates, memory, links, price. A catalogue plus JSON load/save for a
measured machine (written by `rlloom bench hw`)."""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from importlib import metadata
from pathlib import Path

import yaml

GB = 1e9
TB = 1e12
GIB = 2**30
IB_400G = 50 * GB  # one 400 Gb/s NIC per GPU, per direction


@dataclass(frozen=True)
class Hardware:
    """One accelerator type and the links around it. Bandwidths are per direction, per device."""
    name: str
    peak_flops: dict[str, float]  # dense (no sparsity) FLOP/s per dtype: "bf16", "fp32"
    mem_gib: float
    mem_bw: float  # HBM bytes/s
    intra_node_bw: float  # bytes/s one device can push to its peers (NVLink / Infinity Fabric)
    inter_node_bw: float  # bytes/s one device can push across nodes (its NIC)
    devices_per_node: int = 8
    intra_node_latency: float = 5e-6  # s per collective step; NVLink hops are a few µs
    inter_node_latency: float = 1e-5  # s per collective step over InfiniBand / RoCE
    price_per_hour: float = 0.0  # USD per device-hour, indicative on-demand cloud price
    # Fractions of peak that real kernels reach; defaults are typical large-GEMM MFU and
    # streaming-read bandwidth; `rlloom perf calibrate` fits one scale of both to measured runs.
    compute_eff: float = 0.5
    mem_eff: float = 0.8
    comm_eff: float = 0.8
    # Of `mem_eff`, what a decode step's attention gets reading the KV cache: many small
    # per-(row, head) products over strided cache rows, which stream worse than one large
    # read; 1 in the catalogue (no GPU measurement yet), fitted by `calibrate` on a CPU.
    attn_eff: float = 1.0
    # Seconds per causal score element and query head of a teacher-forced forward's fused
    # attention kernel where its per-element softmax work, not its FLOPs, bounds it (a
    # backward costs two forwards): on a CPU 3-6 ns whatever the head dimension, 4-20
    # GFLOP/s of attention against 130-190 for matmuls. `rlloom bench hw` measures it; 0 in the
    # catalogue (a GPU's flash attention is bound by its FLOPs).
    attn_elem_s: float = 0.0
    # Host time of dispatching one operator of rlloom's eager PyTorch runtime (Python, the
    # dispatcher, a kernel launch). On a CPU every operator also runs in that thread, so tiny
    # models are bound by it. On a GPU the host queues kernels and runs ahead, so dispatch
    # costs only where it outlasts the kernels (`dispatch_overlap`): decode steps of few rows,
    # thousands of small operators each. Catalogue GPUs: 5 us, an estimate for a server CPU
    # (`rlloom bench hw` measures it on the machine it runs on).
    launch_s: float = 0.0
    # Host time per operator of the runtime's assessment and training stages where it exceeds
    # a plain forward's (`launch_s`): the stage code's Python between operators, the
    # objective's and the scoring's small operators, the length bucketing. `rlloom bench hw`
    # measures both by running the runtime on a model too small to compute (16 prompts x 4
    # samples): 2-3x and 1.5-2x `launch_s` on a 2-core CPU. 0: `launch_s` (the catalogue).
    assess_launch_s: float = 0.0
    train_launch_s: float = 0.0
    # Share of the host's dispatch time the device's work hides: a GPU step costs the longer
    # of the two (1 in the catalogue); a CPU computes in the dispatching thread (0: the sum).
    dispatch_overlap: float = 0.0
    # Host costs of the runtime's data-parallel wrappers (FSDP2), measured by `rlloom bench
    # hw`; 0 on catalogue GPUs for the reason above. `sharded_launch_s`: added per optimizer-
    # step operator (clipping, AdamW) on DTensor parameters. `wrapped_pass_s`: the hooks of
    # one wrapped module (a decoder layer, the root) per forward and backward of a micro-batch.
    sharded_launch_s: float = 0.0
    wrapped_pass_s: float = 0.0
    # `reduce_s`: one wrapped module's gradient all-reduce (ZeRO 0/1) as replicate issues it
    # from its backward hook while the other ranks compute too; a floor under the link
    # model's price of it. On a 2-core CPU, gloo's all-reduce of a layer's gradients there
    # takes milliseconds where idle ranks take 0.1 ms. 0 in the catalogue.
    reduce_s: float = 0.0
    # Share of the data-parallel collectives (FSDP2's parameter all-gathers and gradient
    # reduce-scatters, replicate's all-reduce) that runs under the layers' compute. FSDP2
    # prefetches the next layer's gather and reduces a layer's gradients while the backward
    # goes on, on their own CUDA streams: 1 on catalogue GPUs. On a CPU, gloo collectives
    # run in the thread that waits on them: 0.
    dp_overlap: float = 0.0
    # Host time of one decode step of the generation engine that the device does not hide
    # (scheduling, sampling, Python between kernels); paid by every step however small its
    # batch, it sets the floor under a long response's tail. 0 in the catalogue (the
    # engine's operators are priced by `launch_s`; vLLM replays CUDA graphs and its
    # scheduler's time is what this holds); `calibrate` fits it.
    decode_step_s: float = 0.0
    # The driver's round trip for one stage call on a group (the call reaching its ranks, the
    # batch handed over, the result back): the gap a run's trace shows between a stage and
    # the one it waited for, which the stages' own spans leave out. Paid once per stage call
    # on a step's critical chain. 0 in the catalogue (milliseconds against steps of tens of
    # seconds); `rlloom perf calibrate` measures it from the runs' trace.json.
    call_s: float = 0.0
    # Host side, for offloaded ZeRO-3 state (`Layout.offload`), per device: bytes/s between
    # device and host memory (its PCIe link; 0: the device is the host, nothing is copied),
    # host memory in GiB, and the bytes/s of host memory the CPU optimizer step streams.
    # Catalogue GPUs: an 8-GPU server with 2 TB of host memory and two sockets of DDR5
    # (about 600 GB/s), shared by its 8 GPUs.
    host_link_bw: float = 0.0
    host_mem_gib: float = 0.0
    host_mem_bw: float = 0.0
    # a measured file's provenance (`rlloom bench hw`): the rlloom that measured it; `extra`
    # holds when (`measured_at`, Unix seconds), its microbenchmarks' worst spread
    # (`spread_max`) and the share of the machine's CPUs other processes used meanwhile
    # (`other_load`); `measurement_doubts` reads them
    rlloom_version: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def mem_bytes(self) -> float:
        return self.mem_gib * GIB

    def flops(self, dtype: str = "bf16") -> float:
        """Achievable FLOP/s (peak times compute_eff)."""
        return self.peak_flops[dtype] * self.compute_eff

    def key(self) -> tuple:
        """Every field's value, for caches of prices (not the object's id, which a discarded
        variant's successor may reuse, e.g. in `perf.validation.validate.calibrate`)."""
        return tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                     for k, v in vars(self).items())

    def stage_launch_s(self, stage: str) -> float:
        """Host seconds per operator of a stage ("generation", "assessment", "training")."""
        own = {"assessment": self.assess_launch_s, "training": self.train_launch_s}
        return own.get(stage) or self.launch_s

    def save(self, path: str | Path) -> None:
        """Write atomically: a reader sees the old file or the whole new one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)


def load_hardware(path: str | Path) -> Hardware:
    """A hardware file: JSON (as `Hardware.save` and `rlloom bench hw` write it) or YAML with
    the same fields (`Hardware`'s: peak FLOP/s per dtype, memory, HBM bandwidth, intra- and
    inter-node links, ...); unknown or missing fields are named in the error."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"hardware file {path} not found")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a hardware file is a mapping of Hardware fields")
    known = {f.name for f in fields(Hardware)}
    required = {f.name for f in fields(Hardware) if f.default is MISSING
                and f.default_factory is MISSING}
    unknown, missing = sorted(set(data) - known), sorted(required - set(data))
    if unknown or missing:
        raise ValueError(f"{path}: " + "; ".join(
            ([f"unknown fields {unknown}"] if unknown else [])
            + ([f"missing fields {missing}"] if missing else []))
            + f" (fields: {', '.join(sorted(known))})")

    def number(key: str, value: object) -> float:
        try:  # YAML reads 1e15 (no dot) as a string
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}") from None
    for key, value in data.items():
        if key in ("peak_flops", "extra"):
            data[key] = {k: number(f"{key}.{k}", v) for k, v in dict(value).items()}
        elif key == "devices_per_node":
            data[key] = int(number(key, value))
        elif key not in ("name", "rlloom_version"):
            data[key] = number(key, value)
    hw = Hardware(**data)
    doubts = measurement_doubts(hw)
    if doubts:
        warnings.warn(f"{path}: " + "; ".join(doubts) + ". Its prices may be off: remeasure "
                      "with `rlloom bench hw` while nothing else runs", HardwareWarning,
                      stacklevel=2)
    return hw


class HardwareWarning(UserWarning):
    """A hardware file measured under load, with noisy repeats, or by another rlloom."""


# a measurement is doubted when its repeats spread wider, or others used more of the CPUs
SPREAD_LIMIT = 0.10
LOAD_LIMIT = 0.25


def measurement_doubts(hw: Hardware) -> list[str]:
    """Why a measured hardware file may not hold this machine's quiet rates (empty for a
    catalogue entry and for a clean measurement by this rlloom)."""
    doubts = []
    spread, load = hw.extra.get("spread_max", 0.0), hw.extra.get("other_load", 0.0)
    if spread > SPREAD_LIMIT:
        doubts.append(f"its microbenchmarks' repeats differed by up to {spread:.0%} (limit "
                      f"{SPREAD_LIMIT:.0%})")
    if load > LOAD_LIMIT:
        doubts.append(f"other processes used {load:.0%} of the CPUs while it was measured "
                      f"(limit {LOAD_LIMIT:.0%})")
    if hw.extra.get("quick"):
        doubts.append("it was measured with --quick (timed batches a tenth as long)")
    installed = installed_version()
    if hw.rlloom_version and installed and hw.rlloom_version != installed:
        doubts.append(f"rlloom {hw.rlloom_version} measured it, this is rlloom {installed}")
    return doubts


def installed_version() -> str:
    """The installed rlloom's version ("" when it is not installed)."""
    try:
        return metadata.version("rlloom")
    except metadata.PackageNotFoundError:
        return ""


def local_hardware_path() -> Path:
    """Where `rlloom bench hw` saves this machine's measurements."""
    root = os.environ.get("RLLOOM_CACHE") or Path.home() / ".cache" / "rlloom"
    return Path(root) / "hardware" / "local.json"


def _gpu(name: str, bf16_tflops: float, fp32_tflops: float, mem_gb: float, hbm_tbs: float,
         link_gbs: float, price: float, pcie_gbs: float = 50) -> Hardware:
    return Hardware(name, {"bf16": bf16_tflops * TB, "fp32": fp32_tflops * TB},
                    mem_gib=mem_gb, mem_bw=hbm_tbs * TB, intra_node_bw=link_gbs * GB,
                    inter_node_bw=IB_400G, price_per_hour=price, dp_overlap=1.0,
                    launch_s=5e-6, dispatch_overlap=1.0,
                    host_link_bw=pcie_gbs * GB, host_mem_gib=256, host_mem_bw=75 * GB)


# Vendor datasheets (dense, not the "with sparsity" numbers); NVLink / IF per direction is half
# the bidirectional figure the datasheets print. Host links: PCIe 5.0 x16 moves about
# 50 GB/s each way in practice, PCIe 4.0 x16 (A100) about 25. mem_gib takes the marketed GB
# figure: the usable capacity after driver reservations is close to it. Prices: indicative
# on-demand cloud rates.
HARDWARE: dict[str, Hardware] = {h.name: h for h in [
    # A100 SXM datasheet: 312 TF bf16, 19.5 TF fp32, 1.555 / 2.039 TB/s, NVLink3 600 GB/s bidir.
    _gpu("a100-40gb", 312, 19.5, 40, 1.555, 300, 1.3, pcie_gbs=25),
    _gpu("a100-80gb", 312, 19.5, 80, 2.039, 300, 1.8, pcie_gbs=25),
    # H100 SXM5: 989 TF bf16 dense, 67 TF fp32, 80 GB at 3.35 TB/s, NVLink4 900 GB/s bidir.
    _gpu("h100", 989, 67, 80, 3.35, 450, 2.5),
    # H200 SXM: H100 compute, 141 GB at 4.8 TB/s.
    _gpu("h200", 989, 67, 141, 4.8, 450, 3.5),
    # H20 (China-export Hopper): 148 TF bf16, 44 TF fp32, 96 GB at 4.0 TB/s, NVLink 900 bidir.
    _gpu("h20", 148, 44, 96, 4.0, 450, 1.2),
    # B200 (HGX): 2.25 PF bf16 dense, 80 TF fp32, 180 GB at 8 TB/s, NVLink5 1.8 TB/s bidir.
    _gpu("b200", 2250, 80, 180, 8.0, 900, 5.5),
    # MI300X: 1307 TF bf16 dense, 163 TF fp32, 192 GB at 5.3 TB/s; 7 IF links x 64 GB/s each way.
    _gpu("mi300x", 1307, 163.4, 192, 5.3, 448, 2.5),
]}


def hardware(name: str, **changes: float) -> Hardware:
    """A catalogue entry, optionally with fields replaced (e.g. calibrated efficiencies)."""
    if name == "local":
        path = local_hardware_path()
        if not path.is_file():
            raise KeyError(f"no measurements of this machine at {path}; run `rlloom bench hw`")
        return replace(load_hardware(path), **changes)
    try:
        base = HARDWARE[name]
    except KeyError:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}, local "
                       "(this machine, measured by `rlloom bench hw`)") from None
    return replace(base, **changes)
