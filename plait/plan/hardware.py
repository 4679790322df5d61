"""GPU presets and the cluster they form.

Numbers are vendor datasheet values (dense, i.e. without 2:4 sparsity). Link bandwidths
are per GPU and per direction, which is what a ring collective's busbw is limited by.
Latencies (alpha) are not datasheet values: they are the order of magnitude NCCL reaches
per ring step; the calibration runs use messages of tens of MB, where alpha is invisible,
so they are declared here rather than fitted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    hbm_bytes: float  # memory capacity, bytes
    hbm_bw: float  # memory bandwidth, bytes/s
    nvlink_bw: float  # intra-node, per GPU per direction, bytes/s
    internode_bw: float  # inter-node NIC bandwidth per GPU per direction, bytes/s
    gpus_per_node: int = 8
    # NICs a node has for its GPUs' inter-node traffic (internode_bw each); 0: one a GPU
    # (the DGX presets: rail-optimised, one 200/400 Gb/s NIC per GPU)
    nics_per_node: int = 0
    nvlink_alpha: float = 3e-6  # per ring step, seconds
    internode_alpha: float = 10e-6
    fp32_peak_ratio: float = 0.5  # fp32 GEMMs / bf16 peak: TF32 tensor cores run at half
    # dense float8 (E4M3/E5M2) tensor-core peak / the bf16 peak; 0: no float8 tensor cores
    fp8_peak_ratio: float = 0.0
    # CPU cores of the host that runs the ranks' compute (a `plait calibrate` profile's);
    # 0: not modelled (a GPU does the work). plait/plan/host_share.py
    host_cores: float = 0.0


GB = 1e9
GiB = 2**30

# H100/H800/H200 SXM datasheets: FP8 1,979 TFLOP/s dense against bf16's 989 (the A100
# has no float8 tensor cores: its ratio stays 0)
FP8_HOPPER = 1979 / 989

GPUS: dict[str, GPU] = {
    # NVIDIA A100 datasheet (2021): 312 TFLOP/s bf16 dense; 40 GB HBM2 1,555 GB/s,
    # 80 GB HBM2e 2,039 GB/s; NVLink 3 600 GB/s bidirectional. DGX A100: 8x 200 Gb/s HDR
    # InfiniBand for 8 GPUs = 25 GB/s per GPU.
    "a100-40gb": GPU("a100-40gb", 312e12, 40 * GB, 1555 * GB, 300 * GB, 25 * GB),
    "a100-80gb": GPU("a100-80gb", 312e12, 80 * GB, 2039 * GB, 300 * GB, 25 * GB),
    # NVIDIA H100 datasheet: SXM5 989 TFLOP/s bf16 dense, 80 GB HBM3 3.35 TB/s, NVLink 4
    # 900 GB/s bidirectional. DGX H100: 8x 400 Gb/s ConnectX-7 = 50 GB/s per GPU.
    # FP8 1,979 TFLOP/s dense (the datasheet's 3,958 is with 2:4 sparsity).
    "h100-sxm": GPU("h100-sxm", 989e12, 80 * GB, 3350 * GB, 450 * GB, 50 * GB,
                    fp8_peak_ratio=FP8_HOPPER),
    # H800 SXM (the export variant of the H100 SXM): H100 SXM compute and memory, NVLink
    # 400 GB/s bidirectional (DeepSeek-V3 technical report, section 3.1: 8 GPUs a node on
    # NVLink/NVSwitch, InfiniBand across nodes; section 3.2.2: 50 GB/s IB per GPU).
    "h800": GPU("h800", 989e12, 80 * GB, 3350 * GB, 200 * GB, 50 * GB,
                fp8_peak_ratio=FP8_HOPPER),
    # NVIDIA H200 datasheet: same compute as H100 SXM (FP8 1,979 dense), 141 GB HBM3e at
    # 4.8 TB/s.
    "h200": GPU("h200", 989e12, 141 * GB, 4800 * GB, 450 * GB, 50 * GB,
                fp8_peak_ratio=FP8_HOPPER),
    # NVIDIA DGX/HGX B200 datasheets: 2.25 PFLOP/s bf16 dense per GPU (72 PFLOP/s FP8
    # sparse per 8 GPUs), 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s bidirectional,
    # 8x 400 Gb/s ConnectX-7 per node. FP8 4.5 PFLOP/s dense (the 72 above / 8 / 2).
    "b200": GPU("b200", 2250e12, 180 * GB, 8000 * GB, 900 * GB, 50 * GB,
                fp8_peak_ratio=4500 / 2250),
}


def gpu_by_device_name(device_name: str) -> GPU | None:
    """The preset of a CUDA device by the name torch reports ("NVIDIA H100 80GB HBM3");
    None where no preset has its datasheet (a PCIe H100 peaks lower than the SXM)."""
    name = device_name.upper()
    if "PCIE" in name:
        return None
    for key, preset in (("H200", "h200"), ("H800", "h800"), ("B200", "b200"), ("H100", "h100-sxm"),
                        ("A100", "a100-80gb")):  # both A100s peak alike
        if key in name:
            return GPUS[preset]
    return None


def get_gpu(name: str, **overrides: float | None) -> GPU:
    """A preset, with any explicit values (not None) replacing its fields."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU preset {name!r}; known presets: {', '.join(GPUS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(GPUS[name], **given) if given else GPUS[name]


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    n_gpus: int
    ranks_per_host: int | None = None  # ranks sharing a host's cores; None: a node's
    host_load: float = 0.0  # other work's runnable entities per host (host_share.py)

    @property
    def gpus_per_node(self) -> int:
        return self.gpu.gpus_per_node

    @property
    def nodes(self) -> int:
        return -(-self.n_gpus // self.gpus_per_node)
