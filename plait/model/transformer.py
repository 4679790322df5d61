"""A plain Llama-style decoder. It knows nothing of parallelism.

Token embedding -> n x [RMSNorm -> causal attention (GQA, or MLA: plait/model/mla.py;
RoPE) -> residual,
RMSNorm -> MLP (SwiGLU) -> residual] -> RMSNorm -> LM head.
Strategies are applied to it from outside (module swaps, layer splits, sharding). The
seams they plug into: `Positions` from the top-level forward (RoPE and the causal mask
come from token positions, not from 0..s-1), the attention core `attn.core` (a
parameter-free module a strategy may swap), the MLP factory `make_mlp` and its optional
auxiliary loss, `run_blocks` (the one layer loop, shared with a pipeline stage) and
`materialise` (the one weight initialisation).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from plait.model.layers import CausalAttentionCore, RMSNorm
from plait.model.mla import LatentAttention
from plait.model.moe import MoE
from plait.model.presets import ModelConfig
from plait.model.recompute import Recompute
from plait.model.rope import Positions, RotaryEmbedding, apply_rope, rope_scaling


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core = CausalAttentionCore()

    def forward(self, x: torch.Tensor, positions: Positions) -> torch.Tensor:
        b, s, _ = x.shape
        # head counts come from the weights, so a strategy that shards heads needs no edit here
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, positions.cos, positions.sin), apply_rope(k, positions.cos,
                                                                       positions.sin)
        out = self.core(q, k, v, positions)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020). Dense: it reports no auxiliary loss."""

    aux_loss: torch.Tensor | None = None

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def make_attention(cfg: ModelConfig) -> nn.Module:
    """The attention of a block: GQA (`Attention`) or multi-head latent attention
    (plait/model/mla.py), by `model.attention`. Both keep the same contract: forward(x,
    positions) -> a tensor shaped like x, their parameter-free `core` the one seam a
    strategy swaps, the output projection named `wo`."""
    return LatentAttention(cfg) if cfg.mla else Attention(cfg)


def make_mlp(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    """The MLP of block `layer`: SwiGLU of width cfg.ffn_dim when the model is dense or the
    layer is one of its first `n_dense_layers`, else the MoE block (plait/model/moe.py).

    The contract an MLP keeps: forward(x) -> a tensor shaped like x (tensor parallel's
    region hooks wrap exactly that), and an `aux_loss` attribute, None or the scalar
    auxiliary loss of its last forward (a MoE router's load-balancing loss, Fedus et al.
    2022), which `run_blocks` collects.
    """
    if cfg.n_experts and layer >= cfg.n_dense_layers:
        return MoE(cfg)
    return SwiGLU(cfg.dim, cfg.ffn_dim)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = make_attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = make_mlp(cfg, layer)

    def forward(self, x: torch.Tensor, positions: Positions) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


def run_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, positions: Positions,
               recompute: Recompute | None = None,
               aux_losses: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x through `blocks` in order: the one layer loop, of the model and of a pipeline stage.

    `recompute` (plait/model/recompute.py), when gradients are on: each block keeps only
    its input (full), or its input and the outputs of the saved operator groups
    (selective), and computes the rest again in backward. `aux_losses`: when given, each block's MLP
    auxiliary loss (`mlp.aux_loss`, see `make_mlp`) of this forward is appended to it, in
    block order; a dense MLP reports none, and without the list nothing is looked up.
    """
    checkpoint = recompute is not None and torch.is_grad_enabled()
    for block in blocks:
        if checkpoint:
            x = recompute.block(block, x, positions)
        else:
            x = block(x, positions)
        if aux_losses is not None:
            aux = getattr(block.mlp, "aux_loss", None)
            if aux is not None:
                aux_losses.append(aux)
    return x


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.rope = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.max_seq_len,
                                    rope_scaling(cfg))
        # recomputation is a runtime choice made by the trainer, not a model property
        self.recompute: Recompute | None = None

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               aux_losses: list[torch.Tensor] | None = None,
               docs: torch.Tensor | None = None) -> torch.Tensor:
        """Final normalised hidden states (batch, seq, dim).

        `positions`: each token's position in the full sequence, int64 (seq,) or (batch,
        seq); default 0..seq-1. `aux_losses`: collects the MLPs' auxiliary losses. `docs`:
        packed documents, each token's document (plait/model/packed.py; `Positions.docs`).
        """
        pos = self.rope(tokens.shape[1], tokens.device, positions, docs)
        x = run_blocks(self.layers, self.embed(tokens), pos, self.recompute, aux_losses)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                aux_losses: list[torch.Tensor] | None = None,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab)."""
        return self.head(self.hidden(tokens, positions, aux_losses, docs))


def param_seed(base_seed: int, name: str) -> int:
    """A 63-bit seed from (base seed, parameter name): the same in every layout."""
    digest = hashlib.sha256(f"{base_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_full_param(name: str, shape: torch.Size, cfg: ModelConfig, base_seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name`, independent of any layout.

    Norm weights start at one; output projections (wo, w2) are scaled by 1/sqrt(2 n_layers)
    as in GPT-2 (Radford et al. 2019) so the residual stream's variance stays bounded.
    """
    return init_param_into(torch.empty(shape), name, cfg, base_seed)


def init_param_into(out: torch.Tensor, name: str, cfg: ModelConfig, base_seed: int
                    ) -> torch.Tensor:
    """`init_full_param` written into `out` (a contiguous fp32 host tensor of the full
    shape), bit for bit the same values, without a second full-size temporary: the dry
    run of a large layout initialises billions of elements (benchmarks/dry_run.py)."""
    if name.endswith("norm.weight"):
        return out.fill_(1.0)
    gen = torch.Generator().manual_seed(param_seed(base_seed, name))
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        std = std / (2 * cfg.n_layers) ** 0.5
    return torch.randn(out.shape, generator=gen, out=out).mul_(std)


def _shared_slots(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) slots holding the same parameter, per shared parameter."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
            slots.setdefault(id(p), []).append((m, name))
    return [s for s in slots.values() if len(s) > 1]


def materialise(module: nn.Module, cfg: ModelConfig, seed: int,
                dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", fill: bool = True) -> nn.Module:
    """Allocate a meta-built module (the model or a slice of it) on `device` and fill each
    parameter from its name-seeded full init, then cast to `dtype`.

    Tied parameters (the LM head sharing the embedding) are tied again: `to_empty` gives
    each slot its own tensor. RoPE caches are built here, before any step runs.

    `fill=False` (a dry run, plait/observe/dry_run.py): the parameters are allocated in
    `dtype` and left unwritten, for `fill_in_place` to write once tensor parallelism has
    sliced them. On CPU an unwritten tensor's pages are never touched (reading them maps
    the kernel's zero page), so a full stage that is about to be sliced costs address
    space, not resident memory: the 8B dry run's first stage is 9 GiB whole, 1 GiB a slice.
    """
    shared = _shared_slots(module)
    if not fill:
        module.to(dtype)  # on meta: free, and no cast copy of the full stage later
    module.to_empty(device=device)
    for (first, first_name), *rest in shared:
        for m, name in rest:
            setattr(m, name, getattr(first, first_name))
    if fill:
        fill_in_place(module, cfg, seed)
    for m in module.modules():
        if isinstance(m, RotaryEmbedding):
            m.warm(device)
    module = module.to(dtype)
    for m in module.modules():
        if isinstance(m, MoE):  # its bias and statistics: zero, fp32, on the device
            m.bias.data = m.bias.data.float()
            m.reset_state()
    return module


def fill_in_place(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Write each parameter of `module` from its name-seeded init, in place, at the shape it
    has. A whole parameter gets exactly `init_full_param`'s values; a slice (a dry run
    fills after tensor parallelism cut the stage) gets the first values of its name's
    stream, which are not the reference's slice: a dry run's values are meaningless (what
    it receives is whatever the buffers held), only its shapes and its work matter."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
                init_param_into(p.data, name, cfg, seed)  # in place: no full-size copy
            else:
                p.copy_(init_full_param(name, p.shape, cfg, seed))


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on the meta device, then materialise every parameter from its name-seeded init."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if str(device) == "meta":
        return model
    return materialise(model, cfg, seed, dtype, device)
