"""Tensor parallel: the ranks of a `tp` group hold column and row slices of every linear
layer, the embedding's rows and the LM head's vocabulary, and all-reduce (or, with
sequence parallel, all-gather and reduce-scatter) inside every block
(plait/parallel/tensor.py; Shoeybi et al. 2019, Megatron-LM; Korthikanti et al. 2022 for
sequence parallel)."""

from __future__ import annotations

from plait.dims.record import Config, Dimension, ModelShape, Planned, divisors_text


def splits_kv_heads(tp: int, kv_heads: int) -> bool:
    """KV heads are split when tp divides them and replicated when they divide tp."""
    return not (kv_heads % tp and tp % kv_heads)


def problems(cfg: Config) -> list[str]:
    """Shapes tp must divide (plait/parallel/tensor.py), sequence parallel, and async
    tensor parallel (plait/parallel/async_tp.py), which decomposes SP's collectives."""
    out: list[str] = []
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.tp > 1:
        for what, n in (("n_heads", m.n_heads), ("dim", m.dim), ("ffn_dim", m.ffn_dim)):
            if n % p.tp:
                out.append(f"tp={p.tp} does not divide model.{what}={n}; use tp in "
                           f"{divisors_text(n)}")
        if not splits_kv_heads(p.tp, m.n_kv_heads):
            out.append(
                f"tp={p.tp} and model.n_kv_heads={m.n_kv_heads}: KV heads are split when "
                f"tp divides them and replicated when they divide tp; use tp in "
                f"{divisors_text(m.n_kv_heads)} or a multiple of {m.n_kv_heads}")
    if p.async_tp and not (p.sp and p.tp > 1):
        out.append("parallel.async_tp=true overlaps sequence parallel's all-gather and "
                   "reduce-scatter with the matmuls beside them; it needs --tp > 1 and --sp")
    if p.async_tp and t.precision == "fp8":
        out.append("parallel.async_tp=true with train.precision='fp8': the rings' partial "
                   "matmuls are not built in float8; use --precision bf16 or drop --async-tp")
    if p.sp and p.tp == 1:
        out.append("parallel.sp=true splits the sequence over tp, but tp=1; set "
                   "--tp > 1 or drop --sp")
    elif p.sp and t.seq_len % p.tp:
        out.append(
            f"sequence parallel splits train.seq_len={t.seq_len} over tp={p.tp}; use a "
            f"seq_len that is a multiple of {p.tp} (e.g. {t.seq_len - t.seq_len % p.tp})")
    return out


def plan_sizes(sizes: list[int], shape: ModelShape, ranks_per_node: int) -> list[int]:
    """The planner's tp: inside a node (Stanford CS336, lecture 8's rule), dividing the
    heads (and splitting or replicating the KV heads)."""
    return [t for t in sizes if t <= ranks_per_node and shape.heads % t == 0
            and splits_kv_heads(t, shape.kv_heads)]


def plan_problems(lay: Planned, shape: ModelShape) -> list[str]:
    """A planned tp against the heads, and sequence parallel's split of each rank's
    tokens (the sequence's share on a context-parallel rank)."""
    tp, tokens = lay.sizes["tp"], shape.seq // lay.seq_split
    checks = [
        (shape.heads % tp or not splits_kv_heads(tp, shape.kv_heads),
         f"tp={tp} must divide the {shape.heads} attention heads (and the {shape.kv_heads} "
         "KV heads, or be a multiple of them)"),
        (lay.sp and tp > 1 and tokens % tp,
         f"sequence parallel splits each cp rank's {tokens} tokens over tp={tp}; use a "
         f"sequence that is a multiple of {lay.seq_split * tp}"),
    ]
    return [msg for bad, msg in checks if bad]


DIMENSION = Dimension(
    name="tp", title="tensor parallel", strategy="plait.parallel.tensor", splits="hidden",
    checkpoint="gathered", color="#d62728", help="tensor-parallel size", problems=problems,
    plan_sizes=plan_sizes, plan_problems=plan_problems,
    words=lambda p: (["SP"] if p.sp else []) + (["async-TP"] if p.async_tp else [])
    if p.tp > 1 else [],
)
