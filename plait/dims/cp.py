"""Context parallel: the ranks of a `cp` group hold slices of every sequence (queries,
keys and values of their own tokens) and exchange K/V inside attention
(plait/parallel/context.py; Liu et al. 2023, "Ring Attention"; Llama 3's all-gathered K/V,
Dubey et al. 2024, section 3.3.2). Parameters are whole on every cp rank, so their
gradients are summed over cp with dp's."""

from __future__ import annotations

from plait.dims.record import Config, Dimension, ModelShape, Planned, Setting, divisors_text

MODES = ("ring", "allgather", "a2a", "hierarchical")
LAYOUTS = ("zigzag", "contiguous")
PLAN_MAX = 32  # the planner's search tries powers of two up to this


def chunks(cp: int, layout: str) -> int:
    """The pieces each sequence is cut into: zigzag gives rank i chunks i and 2cp-1-i."""
    return 2 * cp if layout == "zigzag" else cp


def a2a_degree(p) -> int:
    """The hierarchical mode's all-to-all group: parallel.cp_a2a, or (0) the cp ranks one
    node holds (cp is next to tp, innermost but for it), the largest divisor of cp that
    fits beside tp in gpus_per_node."""
    if p.cp_a2a:
        return p.cp_a2a
    fit = max(p.gpus_per_node // max(p.tp, 1), 1)
    return max(d for d in range(1, p.cp + 1) if p.cp % d == 0 and d <= fit)


def problems(cfg: Config) -> list[str]:
    """The cp mode and layout, and the sequence cp (and SP within it) must split."""
    p, t = cfg.parallel, cfg.train
    n = chunks(p.cp, p.cp_layout)
    checks = [
        (p.cp_mode not in MODES,
         f"parallel.cp_mode={p.cp_mode!r}; use one of {', '.join(MODES)}"),
        (p.cp_layout not in LAYOUTS,
         f"parallel.cp_layout={p.cp_layout!r}; use 'zigzag' or 'contiguous'"),
        (p.cp > 1 and t.seq_len % n,
         f"cp={p.cp} ({p.cp_layout}) cuts train.seq_len={t.seq_len} into {n} equal "
         f"chunks; use a seq_len that is a multiple of {n} (e.g. "
         f"{max(t.seq_len - t.seq_len % n, n)})"),
        (p.cp > 1 and p.sp and t.seq_len % n == 0 and (t.seq_len // p.cp) % p.tp,
         f"sequence parallel splits each cp rank's {t.seq_len // max(p.cp, 1)} tokens over "
         f"tp={p.tp}; use a seq_len that is a multiple of {n * p.tp}"),
    ]
    return ([problem for broken, problem in checks if broken] + _a2a_problems(cfg)
            + _hierarchical_problems(cfg) + _fp8_tile_problems(cfg))


def _fp8_tile_problems(cfg: Config) -> list[str]:
    """Float8's blockwise recipe scales each tile from its own amax, reducing none over
    ranks: a chunk of a sequence must be whole weight-gradient tiles (they run along the
    sequence), and packed documents, whose split moves tokens between ranks, would cut
    them (plait/config/fp8_checks.py has the recipe's other rules)."""
    p, t = cfg.parallel, cfg.train
    if p.cp == 1 or t.precision != "fp8" or t.fp8_recipe != "blockwise" or t.fp8_block < 1:
        return []
    n, b, out = chunks(p.cp, p.cp_layout), t.fp8_block, []
    if t.seq_len % n == 0 and (t.seq_len // n) % b:
        out.append(f"train.fp8_block={b} with cp={p.cp}: each of the {n} sequence chunks "
                   f"({t.seq_len // n} tokens) must be whole weight-gradient tiles; set "
                   f"train.fp8_block to one of {divisors_text(t.seq_len // n)}")
    if t.documents:
        out.append("train.fp8_recipe='blockwise' with packed documents under cp>1 is not "
                   "built (the documents' split moves tokens between cp ranks, cutting the "
                   "weight-gradient tiles); drop train.documents or use the tensorwise recipe")
    return out


def _hierarchical_problems(cfg: Config) -> list[str]:
    """The all-to-all group divides cp and the heads of a tp rank."""
    p, m = cfg.parallel, cfg.model
    if p.cp_a2a < 0 or (p.cp_a2a and p.cp % p.cp_a2a):
        return [f"parallel.cp_a2a={p.cp_a2a} must divide cp={p.cp} (0: the cp ranks of a "
                "node)"]
    if p.cp_mode != "hierarchical" or p.cp == 1:
        return [] if not p.cp_a2a or p.cp_mode == "hierarchical" else [
            f"parallel.cp_a2a={p.cp_a2a} sets the hierarchical mode's all-to-all; use "
            "--cp-mode hierarchical or drop it"]
    a, heads = a2a_degree(p), m.n_heads // max(p.tp, 1)
    if heads % a:
        return [f"cp_mode=hierarchical splits the {heads} query heads of a tp rank over its "
                f"all-to-all group of {a}; use --cp-a2a dividing {heads}"]
    return []


def _a2a_problems(cfg: Config) -> list[str]:
    """a2a splits each tp rank's query heads over cp; its KV heads, which divide them, are
    repeated to lcm(KV heads, cp), which then divides them too."""
    p, m = cfg.parallel, cfg.model
    if p.cp_mode != "a2a" or p.cp == 1:
        return []
    heads = m.n_heads // max(p.tp, 1)
    if m.n_heads % max(p.tp, 1) or heads % p.cp:
        return [f"cp_mode=a2a splits the {heads} query heads of a tp rank (model.n_heads="
                f"{m.n_heads} / tp={p.tp}) over cp={p.cp}; use tp x cp <= n_heads with cp "
                f"dividing n_heads / tp, or cp_mode ring"]
    return []


def plan_sizes(sizes: list[int], shape: ModelShape, ranks_per_node: int) -> list[int]:
    """The planner's cp: powers of two up to PLAN_MAX that cut the sequence into the
    zigzag layout's chunks (causal load balancing)."""
    return [c for c in sizes if c == 1 or not (shape.seq % chunks(c, "zigzag")
                                              or c & (c - 1) or c > PLAN_MAX)]


def plan_problems(lay: Planned, shape: ModelShape) -> list[str]:
    """A planned cp against the sequence it cuts into zigzag chunks."""
    cp = lay.sizes["cp"]
    if cp > 1 and shape.seq % chunks(cp, "zigzag"):
        return [f"cp={cp}: the sequence {shape.seq} must split into 2*cp chunks (causal load "
                "balancing)"]
    return []


DIMENSION = Dimension(
    name="cp", title="context parallel", strategy="plait.parallel.context",
    splits="sequence", replicates_params=True, sums_loss=True, checkpoint="copies",
    settings=(Setting("cp_mode", MODES, "context parallel: K/V around a ring "
                      "(parallel.cp_mode, default ring), all-gathered, heads exchanged "
                      "by all-to-all (a2a, Ulysses), or all-to-all inside a node and a "
                      "ring across nodes (hierarchical, --cp-a2a)"),
              Setting("cp_a2a", (), "hierarchical context parallel: ranks of each "
                      "all-to-all group, a ring across the groups (parallel.cp_a2a, default 0: "
                      "the cp ranks of a node)"),
              Setting("cp_layout", LAYOUTS, "context parallel: load-balanced zigzag chunks "
                      "(parallel.cp_layout, default zigzag) or contiguous slices")),
    color="#17becf", help="context-parallel size", problems=problems,
    plan_sizes=plan_sizes, plan_problems=plan_problems,
    words=lambda p: [f"cp {p.cp_mode}"] if p.cp > 1 else [],
)
