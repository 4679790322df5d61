"""Hardware profiles: what `plait calibrate` measured, fitted into the planner's terms.

A profile (JSON, written by plait/calibrate/machine.py) holds the raw measurements and the fit:

- GEMMs: (m, k, n, dtype, seconds) -> the efficiency curve eff(W) = gemm_max W /
  (W + gemm_half) of plait/plan/compute.py against `peak` = the best fp32 throughput
  measured, by least squared log error on a fixed grid (deterministic). bf16's best over
  fp32's is `fp32_peak_ratio`'s inverse: the planner's peak is the bf16 one, as a GPU
  datasheet's, and fp32 runs at peak x fp32_peak_ratio. One curve serves both dtypes.
- attention: causal SDPA forward + backward FLOPs (3 x 4 b s^2 h / 2) and seconds ->
  attention_scale, the median of measured throughput over the GEMM curve's at the same
  FLOPs (the planner runs the core's forward time 3 times: forward, and 2 x in backward).
- memory bandwidth: a large copy, read + write bytes over seconds -> hbm_bw.
- dispatch: aten operations of plait's block (forward + backward) and optimizer, counted
  on 1- and 2-layer models, and a tiny model's step seconds per operation -> op_seconds,
  layer_ops / outside_ops / optimizer ops (Efficiency's per-operation terms; a GPU stack's
  fused kernels make these 0 for the presets); the same step under selective recompute
  -> policy_layer_seconds (its dispatch-mode policy per layer and micro-batch).
- collectives, per op and group size n: the ledger's algorithmic bytes per rank and
  seconds -> t = steps x alpha + bytes / B by least squares (steps: 2(n-1) ring steps for
  all-reduce, n-1 for all-gather / reduce-scatter), the alpha-beta terms of
  plait/plan/comm/price.py. The planner's links take all-reduce's B and alpha of the largest
  group (one machine: intra- and inter-node alike, there being no second node measured),
  and link_efficiency = 1 (B is achieved bandwidth, not a datasheet's).
  The CPU seconds per call of every thread of the rank (the caller's, gloo's) -> comm_cpu,
  a line in the payload bytes over the three ops (host_share.py: what needs a core).
- sync: a latency-bound all-reduce issued after compute on every rank (measure_sync in
  plait/calibrate/steps.py): the mean seconds it took once the last rank arrived, less
  the alpha-beta fit's price of that call (fitted on the fastest call of back-to-back
  runs), per segment of compute -> sync_after (their mean: sync_extra), a larger call's
  more per byte (the calls' medians) -> sync_per_byte; the mean wait for the last rank
  after each segment -> desync_compute / desync_wait (plait/plan/comm/sync.py's
  sync_seconds: the blocking calls only).
  The sync numbers are means over every call of the repeats (a call's extra is
  heavy-tailed here: a median flipped between its modes from calibrate to calibrate);
  each repeat's mean extra is kept -> sync_spread (lowest, median, highest per segment;
  reported only).
- posts: a batch of pipeline transfers posted after compute (measure_post): its mean wall
  seconds -> p2p_post, the shared simulator's `post` (a rank's time per batch of
  transfers, idle: in the bubble line). Completing the transfers after more compute is
  recorded (`complete_seconds`), not priced: 0.1-4.7 ms in repeats minutes apart here, it
  holds the wake-up latency the pipeline's p2p latency already carries.
- the pipeline runtime's gap: plait's runtime trained at pp = 2 (measure_gap), its mean
  time before a compute action that did not wait (the loop's Python, completing a
  receive already there), the median of repeats -> pipeline_gap, the shared simulator's
  `gap` per compute action (idle, overlapping any wait for the input).
- the tp floor (plait/calibrate/tp.py): plait's floor step trained at tp = 2 with two
  ranks a core, 1 and 2 layers, recompute none and selective, each rank's process CPU a
  step -> tp_shared_layer_seconds* and tp_shared_outside_seconds* (one layer's CPU and
  the rest of the step's the planner's per-operation and comm_cpu prices leave out where
  cores are shared: fit_tp_floor).
- concurrent GEMMs: a few fp32 shapes timed on every rank at once -> concurrent_gemm, the
  median of alone / together seconds (<= 1): the GEMM (and attention) rate of a rank
  whose host runs other ranks too (plait/plan/basis.py's basis_of).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from plait.plan.compute import Efficiency
from plait.plan.hardware import GPU

PROFILE_VERSION = 1
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
              "reduce_scatter": lambda n: n - 1}


def gemm_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def fit_gemm_curve(flops: list[float], seconds: list[float]) -> dict[str, float]:
    """peak (the best throughput), gemm_max and gemm_half minimising the squared log error
    of eff(W) x peak against the measured throughputs (a 2-D grid: no start to choose)."""
    w = np.asarray(flops, dtype=float)
    thr = w / np.asarray(seconds, dtype=float)
    peak = float(thr.max())
    maxes = np.linspace(0.5, 2.0, 151)[:, None]
    halves = np.logspace(math.log10(w.min()) - 3, math.log10(w.max()) + 1, 400)[None, :]
    pred = maxes[..., None] * w / (w + halves[..., None]) * peak  # (max, half, point)
    err = ((np.log(pred) - np.log(thr)) ** 2).sum(-1)
    i, j = np.unravel_index(int(np.argmin(err)), err.shape)
    return {"peak_flops": peak, "gemm_max": float(maxes[i, 0]),
            "gemm_half": float(halves[0, j]),
            "rms_log_error": math.sqrt(float(err[i, j]) / len(w))}


def curve(work: float, fit: dict[str, float]) -> float:
    """Throughput of a GEMM of `work` FLOPs on the fitted curve."""
    return fit["peak_flops"] * fit["gemm_max"] * work / (work + fit["gemm_half"])


def fit_alpha_beta(op: str, n: int, sent: list[float], seconds: list[float]) -> dict[str, float]:
    """alpha (seconds per ring step) and B (bytes/s) of t = steps alpha + sent / B."""
    x, t = np.asarray(sent, dtype=float), np.asarray(seconds, dtype=float)
    slope, intercept = (float(v) for v in np.polyfit(x, t, 1))
    steps = RING_STEPS[op](n)
    if slope <= 0 or intercept < 0:  # noise (a loaded machine): bound each term instead
        i, j = int(np.argmin(x)), int(np.argmax(x))
        return {"alpha_s": float(t[i]) / steps, "bandwidth_Bps": float(x[j] / t[j]),
                "bounds": True}  # the smallest call all latency, the largest all bandwidth
    return {"alpha_s": intercept / steps, "bandwidth_Bps": 1.0 / slope}


def fit_profile(raw: dict[str, Any]) -> dict[str, Any]:
    """The planner's numbers from a profile's measurements."""
    g32 = [r for r in raw["gemm"] if r["dtype"] == "float32"]
    g16 = [r for r in raw["gemm"] if r["dtype"] == "bfloat16"]
    fit = fit_gemm_curve([gemm_flops(r["m"], r["k"], r["n"]) for r in g32],
                         [r["seconds"] for r in g32])
    best16 = max((gemm_flops(r["m"], r["k"], r["n"]) / r["seconds"] for r in g16),
                 default=fit["peak_flops"])
    att = [r["flops"] / r["seconds"] / curve(r["flops"], fit) for r in raw["attention"]]
    links = {}
    for key, rows in raw["collectives"].items():
        op, n = key.rsplit("@", 1)
        links[key] = fit_alpha_beta(op, int(n), [r["sent"] for r in rows],
                                    [r["seconds"] for r in rows])
    largest = max((int(k.rsplit("@", 1)[1]) for k in links if k.startswith("all_reduce@")),
                  default=None)
    ar = links.get(f"all_reduce@{largest}") if largest else None
    return {"gemm": fit, "bf16_peak_flops": best16, "fp32_peak_ratio": fit["peak_flops"] / best16,
            "dispatch": fit_dispatch(raw.get("dispatch")),
            "comm_overlap": fit_overlap(raw.get("overlap")),
            "sync": fit_sync(raw.get("sync"), ar),
            "sync_spread": fit_sync_spread(raw.get("sync"), ar),
            "p2p_post": float((raw.get("post") or {}).get("post_seconds", 0.0)),
            "pipeline_gap": float((raw.get("pipeline_gap") or {}).get("gap_seconds", 0.0)),
            "comm_cpu": fit_comm_cpu(raw["collectives"], largest),
            "tp_floor": fit_tp_floor(raw.get("tp_floor"), fit_dispatch(raw.get("dispatch")),
                                     fit_comm_cpu(raw["collectives"], largest)),
            "concurrent_gemm": fit_concurrent(raw["gemm"], raw.get("gemm_concurrent")),
            **fit_elementwise(raw.get("elementwise"), raw.get("dispatch")),
            "attention_scale": float(np.median(att)) if att else 1.0,
            "memory_bw_Bps": raw["memory"]["bytes"] / raw["memory"]["seconds"],
            "links": links, "link": ar, "link_group": largest}


def fit_dispatch(d: dict[str, Any] | None) -> dict[str, float]:
    """Operations per layer (forward + backward), outside the layers, per optimizer step
    (per layer and fixed), from the 1- and 2-layer counts; seconds per operation."""
    if not d:
        return {"op_seconds": 0.0, "layer_ops": 0.0, "outside_ops": 0.0,
                "optimizer_layer_ops": 0.0, "optimizer_fixed_ops": 0.0,
                "policy_layer_seconds": 0.0}
    layer = d["step_ops_2"] - d["step_ops_1"]
    opt_layer = d["optimizer_ops_2"] - d["optimizer_ops_1"]
    ops = d.get("runtime_step_ops", d["step_ops_2"])  # the timed step's operations
    op_s = d["step_seconds"] / ops
    # selective's policy per layer (the 2-layer floor step, one micro-batch): the step's
    # extra, less the recomputed operations' dispatch the planner prices already (a third
    # of a layer's: compute.recompute_seconds' element-wise forward)
    policy = (d["step_seconds_selective"] - d["step_seconds"]) / 2 - op_s * layer / 3 \
        if "step_seconds_selective" in d else 0.0
    return {"op_seconds": op_s, "layer_ops": float(layer),
            "outside_ops": float(d["step_ops_1"] - layer),
            "optimizer_layer_ops": float(opt_layer),
            "optimizer_fixed_ops": float(d["optimizer_ops_1"] - opt_layer),
            "policy_layer_seconds": max(policy, 0.0)}


def fit_elementwise(rows: list[dict[str, float]] | None, d: dict[str, Any] | None
                    ) -> dict[str, float]:
    """Element-wise traffic: the bandwidth of plait's block's own element-wise operations
    (replayed at two model sizes with the same operations: the extra bytes of the larger
    over its extra seconds, the per-operation floor cancelling) and `elementwise_passes`,
    the bytes a layer's element-wise operations read and write forward and backward over
    3 x the bytes it saves (compute.layer_times runs a forward's share three times). 0
    passes when not measured (the GPU presets')."""
    if not rows or not d or "elementwise_bytes_2" not in d:
        return {"elementwise_passes": 0.0, "elementwise_bw_Bps": 0.0}
    small, large = min(rows, key=lambda r: r["bytes"]), max(rows, key=lambda r: r["bytes"])
    extra = large["seconds"] - small["seconds"]
    bw = (large["bytes"] - small["bytes"]) / extra if extra > 0 else large["bytes"] / large[
        "seconds"]  # noise: the larger replay's own rate, a lower bound
    layer = d["elementwise_bytes_2"] - d["elementwise_bytes_1"]
    return {"elementwise_passes": layer / (3 * d["layer_saved_bytes"]),
            "elementwise_bw_Bps": bw}


def fit_sync(s: dict[str, Any] | None, link: dict[str, float] | None) -> dict[str, Any]:
    """The extra seconds of a synchronising collective after compute beyond the alpha-beta
    price, per measured segment length (`sync_after`, each the mean over the calls: on
    this machine it grew with the compute before the call) and their mean
    (`sync_extra`), per byte of a larger call after the same compute (`sync_per_byte`),
    and the wait for the last rank per segment length; none when not measured (one
    rank)."""
    if not s or not link:
        return {"sync_extra": 0.0, "desync_compute": (), "desync_wait": (), "sync_after": (),
                "sync_per_byte": 0.0}
    from plait.plan.comm.price import all_reduce

    def extra(row: dict[str, Any], size: float, key: str = "after_seconds") -> float:
        return float(row.get(key, row["after_seconds"])) - float(all_reduce(
            size, s["group"], link["bandwidth_Bps"], link["alpha_s"])[0])  # past the price

    rows = s["segments"]
    small = [extra(r, s["bytes"]) for r in rows]
    # a larger call's extra over the small one's after the same compute, per byte more
    # (cold buffers copied slower than the back-to-back fit's); 0 if it is not larger. The
    # medians' (a profile from before them: the one number): the body of each call's
    # distribution, where a copy's growth shows; its tail (a woken thread's wait for a
    # core, measure_sync) does not grow with the bytes and is in the small call's mean
    at = {r["compute_seconds"]: extra(r, s["bytes"], "after_median_seconds") for r in rows}
    per_byte = [(extra(r, r["bytes"], "after_median_seconds") - at[r["compute_seconds"]])
                / (r["bytes"] - s["bytes"])
                for r in s.get("sizes", []) if r["compute_seconds"] in at]
    larger = [float(r["bytes"]) for r in s.get("sizes", []) if r["compute_seconds"] in at]
    return {"sync_extra": max(float(np.mean(small)), 0.0),
            "desync_compute": tuple(float(r["compute_seconds"]) for r in rows),
            "desync_wait": tuple(max(float(r["wait_seconds"]), 0.0) for r in rows),
            "sync_after": tuple(max(v, 0.0) for v in small),
            "sync_per_byte": max(float(np.mean(per_byte)), 0.0) if per_byte else 0.0,
            "sync_bytes_measured": max(larger, default=float(s["bytes"]))}


def fit_comm_cpu(collectives: dict[str, list], group: int | None) -> dict[str, float]:
    """CPU seconds of a collective per call and per payload byte (every thread of the
    rank: the caller's Python and wait, gloo's threads), a least-squares line through the
    three ops' calls over the largest group, each term at least 0; zeros when not
    measured (older profiles, one rank)."""
    rows = [r for key, rs in collectives.items() if group and key.endswith(f"@{group}")
            for r in rs if "cpu_seconds" in r]
    if len({r["payload"] for r in rows}) < 2:
        return {"call_s": 0.0, "byte_s": 0.0}
    slope, intercept = np.polyfit([float(r["payload"]) for r in rows],
                                  [float(r["cpu_seconds"]) for r in rows], 1)
    return {"call_s": max(float(intercept), 0.0), "byte_s": max(float(slope), 0.0)}


def fit_tp_floor(t: dict[str, Any] | None, dispatch: dict[str, float],
                 comm_cpu: dict[str, float]) -> dict[str, float]:
    """Efficiency's tp_shared_*: per recompute mode, what the floor's process CPU at tp =
    2 with two ranks a core (the mean over the ranks of each rank's mean step) holds
    beyond the planner's prices: its operations (op_seconds x the runtime step's;
    selective a third of a layer's more, the recomputed forward's element-wise
    operations, and its policy) and its calls' comm_cpu (the ledger's calls and payload
    bytes). One layer's (the 2-layer step less the 1-layer one) and the rest of the
    1-layer step's (less one layer: `outside`, the embedding, head, loss, optimizer and
    the calls outside the layers), each at least 0; not measured: {}."""
    if not t or "shared" not in t:
        return {}
    out: dict[str, float] = {}
    d, call_s, byte_s = dispatch, comm_cpu["call_s"], comm_cpu["byte_s"]
    layer_ops = d["op_seconds"] * d["layer_ops"]
    for mode, name in (("none", ""), ("selective", "_selective")):
        one, two = t["shared"][f"{mode}_1"], t["shared"][f"{mode}_2"]
        layer = layer_ops * (4 / 3 if mode == "selective" else 1.0) \
            + (d["policy_layer_seconds"] if mode == "selective" else 0.0)
        step_ops = d["op_seconds"] * (d["outside_ops"] + d["optimizer_fixed_ops"]
                                      + d["optimizer_layer_ops"])

        def price(row: dict[str, float], layers: int, calls: str = "calls",
                  payload: str = "payload_bytes", layer: float = layer) -> float:
            return layers * layer + call_s * row[calls] + byte_s * row[payload]

        extra = two["cpu_seconds"] - one["cpu_seconds"] - (
            price(two, 2, "tp_calls", "tp_payload_bytes")
            - price(one, 1, "tp_calls", "tp_payload_bytes"))
        outside = one["cpu_seconds"] - extra - price(one, 1) - step_ops
        out[f"tp_shared_layer_seconds{name}"] = max(float(extra), 0.0)
        out[f"tp_shared_outside_seconds{name}"] = max(float(outside), 0.0)
    return out


def fit_sync_spread(s: dict[str, Any] | None, link: dict[str, float] | None
                    ) -> list[dict[str, float]]:
    """How far the repeats of each segment's extra (after the last arrival, less the
    alpha-beta price) lie apart: their lowest, median and highest, per segment (a profile
    from before the repeats were kept: none). Reported, not priced: the planner takes the
    mean over every call (`fit_sync`)."""
    if not s or not link or not all("after_repeats" in r for r in s["segments"]):
        return []
    from plait.plan.comm.price import all_reduce

    price = float(all_reduce(s["bytes"], s["group"], link["bandwidth_Bps"],
                             link["alpha_s"])[0])
    out = []
    for r in s["segments"]:
        extra = sorted(float(a) - price for a in r["after_repeats"])
        out.append({"compute_seconds": float(r["compute_seconds"]), "low": extra[0],
                    "median": float(np.median(extra)), "high": extra[-1]})
    return out


def fit_concurrent(alone: list[dict[str, Any]], together: list[dict[str, Any]] | None
                   ) -> float:
    """GEMM throughput with every rank of the host computing at once over one alone: the
    median over the shapes timed both ways of alone seconds / together seconds, at most 1
    (faster together is noise); 1 when not measured (one rank, the GPU presets)."""
    seconds = {(r["m"], r["k"], r["n"]): r["seconds"] for r in alone
               if r["dtype"] == "float32"}
    ratios = [seconds[key] / r["seconds"] for r in together or []
              if (key := (r["m"], r["k"], r["n"])) in seconds and r["seconds"] > 0]
    return float(min(np.median(ratios), 1.0)) if ratios else 1.0


def fit_overlap(o: dict[str, float] | None) -> float:
    """The share of the shorter of a collective and a compute that runs hidden when both
    are issued together: (alone + alone - together) / the shorter, in [0, 1]; 1 (a GPU's
    full overlap, the presets') when nothing was measured (one rank)."""
    if not o:
        return 1.0
    comm_s, comp_s = o["comm_seconds"], o["compute_seconds"]
    hidden = (comm_s + comp_s - o["both_seconds"]) / min(comm_s, comp_s)
    return float(min(max(hidden, 0.0), 1.0))


def profile_hardware(profile: dict[str, Any]) -> tuple[GPU, Efficiency]:
    """The GPU record and efficiency constants `plait plan --hardware` plans with."""
    fit = profile["fit"]
    link = fit["link"] or {"alpha_s": 0.0, "bandwidth_Bps": 1e30}  # one rank: no link
    gpu = GPU(profile["name"], fit["bf16_peak_flops"], profile["memory_bytes"],
              fit["memory_bw_Bps"], link["bandwidth_Bps"], link["bandwidth_Bps"],
              gpus_per_node=profile["ranks_per_node"], nvlink_alpha=link["alpha_s"],
              internode_alpha=link["alpha_s"], fp32_peak_ratio=fit["fp32_peak_ratio"],
              host_cores=float(profile.get("cores", 0.0)))  # plait/plan/host_share.py
    g = fit["gemm"]
    # a measured profile prices the collectives plait's runtime issues (the ledger's, per
    # ZeRO unit and outside the layers too), hidden by the overlap the machine showed
    eff = Efficiency(g["gemm_max"], g["gemm_half"], 1.0, fit.get("elementwise_passes", 0.0),
                     attention_scale=fit["attention_scale"],
                     elementwise_bw=fit.get("elementwise_bw_Bps", 0.0),
                     **fit.get("dispatch") or fit_dispatch(None),
                     comm_overlap=fit.get("comm_overlap", 1.0), runtime_comm=True,
                     concurrent_gemm=fit.get("concurrent_gemm", 1.0),
                     p2p_post=fit.get("p2p_post", 0.0),
                     pipeline_gap=fit.get("pipeline_gap", 0.0),
                     comm_cpu_call=(fit.get("comm_cpu") or {}).get("call_s", 0.0),
                     comm_cpu_byte=(fit.get("comm_cpu") or {}).get("byte_s", 0.0),
                     **fit.get("tp_floor", {}),
                     **{k: tuple(v) if isinstance(v, list) else v
                        for k, v in (fit.get("sync") or fit_sync(None, None)).items()})
    return gpu, eff


def load_profile(path: str | Path) -> dict[str, Any]:
    """A profile file; ValueError names what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--hardware {path}: {'is a directory' if p.is_dir() else 'not found'}"
                         "; give the JSON plait calibrate --out wrote")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--hardware {path} is not a profile plait calibrate wrote ({e})"
                         ) from None
    need = ("version", "name", "memory_bytes", "ranks_per_node", "fit", "raw")
    missing = [k for k in need if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise ValueError(f"--hardware {path} lacks {', '.join(missing)}: give the JSON "
                         "plait calibrate --out wrote")
    if doc["version"] != PROFILE_VERSION:
        raise ValueError(f"--hardware {path} is profile version {doc['version']}; this plait "
                         f"reads version {PROFILE_VERSION}: rerun plait calibrate")
    return doc


def hardware_of(args: Any) -> tuple[GPU | None, Efficiency]:
    """`plait plan --hardware`'s GPU record and efficiency constants, or without it (None,
    the preset's published constants: plait/plan/gpu_data.py), or with `--efficiency
    fitted` (None, the calibration set's constants)."""
    from plait.plan.calibration import EFFICIENCY
    from plait.plan.gpu_data import published
    from plait.plan.hardware import get_gpu

    kernel = getattr(args, "attention_kernel", "auto")
    published_numbers = (not getattr(args, "hardware", None)
                         and getattr(args, "efficiency", "published") != "fitted")
    if kernel != "auto" and not published_numbers:
        raise ValueError(f"--attention-kernel {kernel} picks a published attention sweep: "
                         "drop it with --hardware or --efficiency fitted")
    if not getattr(args, "hardware", None):
        if getattr(args, "efficiency", "published") == "fitted":
            return None, EFFICIENCY
        pub = published(get_gpu(args.gpu or "h100-sxm"), kernel)
        return None, EFFICIENCY if pub is None else pub.eff
    if args.gpu is not None:
        raise ValueError(f"give --gpu {args.gpu} or --hardware {args.hardware}, not both")
    return profile_hardware(load_profile(args.hardware))


def base_gpu(args: Any, over: dict[str, Any]) -> GPU:
    """The --gpu preset (h100-sxm by default; with its published bus bandwidths and usable
    memory unless `--efficiency fitted`) or the profile, with the explicit hardware flags
    (`over`) replacing its values."""
    from dataclasses import replace

    from plait.plan.gpu_data import published
    from plait.plan.hardware import get_gpu

    profiled, _ = hardware_of(args)
    if profiled is None:
        gpu = get_gpu(args.gpu or "h100-sxm")
        pub = published(gpu) if getattr(args, "efficiency", "published") != "fitted" else None
        gpu = gpu if pub is None else pub.gpu
        return replace(gpu, **over) if over else gpu
    return replace(profiled, **over) if over else profiled
