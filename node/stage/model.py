"""The model: a Llama-style decoder and its pipeline split into a head stage and block stages.

Owns the architecture (``ModelConfig``, presets), the split into ``1 + N`` stages
(``docs/algorithms.md`` section 1), deterministic per-stage initialisation from the swarm seed, and
the composition of stages back into one ``FullModel`` for offline evaluation and tests.
Does not own training loops, optimisers, devices, data or anything on the wire.

Architecture, after Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation
Language Models", section 2.2): RMSNorm pre-norm blocks, rotary position embeddings (Su et
al. 2021, "RoFormer"), SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer"), no
biases, no dropout, untied embedding and LM head. Stability practice from YaLM-100B
(``docs/algorithms.md`` section 9): an extra RMSNorm right after the token embedding, norms, RoPE and
the loss computed in fp32, and the residual stream kept in the dtype of its input, so under
``torch.autocast(..., dtype=torch.bfloat16)`` the matmuls run in bf16 while the residual
stays fp32.

``ModelConfig.embed_norm`` turns that embedding norm off, which makes the model exactly
Llama's (a swarm started from a Llama checkpoint, ``node.stage.hf``).

Stage 0 (``HeadStage``) holds the token embedding, the embedding norm, the final norm and
the LM head; stages ``1..N`` (``BlockStage``) hold ``num_blocks // N`` consecutive blocks
each, with identical parameter names and shapes, so CheckFree can average neighbour stages
key by key.

Generation keeps a ``KVCache`` (the keys and values of every position already seen, per
block; Pope et al. 2022, "Efficiently Scaling Transformer Inference", section 2), so that
``FullModel`` computes only the new positions of each forward.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Bump when a change to this module changes the maths of a model built from the same
# (cfg, N, seed), so fingerprints of incompatible peers differ.
ARCHITECTURE_VERSION = "llama-yalm-1"


@dataclass(frozen=True)
class ModelConfig:
    """Shape and initialisation of the decoder; the defaults are the "tiny" preset."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level tokenizer."""

    d_model: int = 128
    """Width of the residual stream."""

    num_heads: int = 4
    """Attention heads per block; ``d_model / num_heads`` must be an even head width."""

    num_blocks: int = 6
    """Transformer blocks in the whole model, split evenly over the block stages."""

    ffn_dim: int = 352
    """Hidden width of the SwiGLU MLP (about 8/3 of ``d_model``, rounded up)."""

    max_seq_len: int = 128
    """Longest sequence the model accepts."""

    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""

    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""

    init_std: float = 0.02
    """Standard deviation of the normal init of linear and embedding weights; output
    projections of attention and MLP use ``init_std / sqrt(2 * num_blocks)``."""

    embed_norm: bool = True
    """An RMSNorm right after the token embedding (YaLM's stability practice); false gives
    exactly the Llama architecture, as a model started from a Llama checkpoint has it."""

    checkpoint: str = ""
    """Content hash of the Hugging Face checkpoint the swarm started from, set from its files
    by ``node join --init hf:DIR`` (never by hand); empty for a swarm started from the seed.
    Part of the fingerprint, so swarms started from different checkpoints never mix."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_heads", "num_blocks", "ffn_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if (self.d_model // self.num_heads) % 2 != 0:
            raise ValueError(
                f"head width d_model/num_heads = {self.d_model // self.num_heads} must be even "
                "for rotary embeddings"
            )
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("ModelConfig.rope_theta, norm_eps and init_std must be > 0")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def block_params(self) -> int:
        """Parameters of one block: two norms, four attention and three MLP matrices."""
        return 4 * self.d_model**2 + 3 * self.d_model * self.ffn_dim + 2 * self.d_model

    def head_params(self) -> int:
        """Parameters of the head stage: embedding, its norm (if any), the final norm and the
        (untied) LM head."""
        norms = 2 if self.embed_norm else 1
        return 2 * self.vocab_size * self.d_model + norms * self.d_model

    def num_params(self) -> int:
        """Parameters of the whole model (head stage plus all blocks)."""
        return self.head_params() + self.num_blocks * self.block_params()


PRESETS: dict[str, ModelConfig] = {
    # 1,271,552 params; learns byte-level text visibly on 2 CPU cores in a few minutes.
    "tiny": ModelConfig(),
    # 6,459,904 params.
    "small": ModelConfig(d_model=256, num_heads=8, num_blocks=8, ffn_dim=688, max_seq_len=256),
    # GPT-3-small-like: 85,347,840 params, of which 84,953,088 in blocks (7,079,424 each).
    "125m": ModelConfig(d_model=768, num_heads=12, num_blocks=12, ffn_dim=2048, max_seq_len=1024),
}


def preset(name: str) -> ModelConfig:
    """The named preset config."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def stage_blocks(cfg: ModelConfig, num_block_stages: int, stage: int) -> range:
    """Global indices of the blocks held by ``stage``; stage 0 (the head stage) holds none."""
    if num_block_stages < 1:
        raise ValueError(f"num_block_stages must be >= 1, got {num_block_stages}")
    if cfg.num_blocks % num_block_stages != 0:
        raise ValueError(
            f"num_blocks ({cfg.num_blocks}) is not divisible by num_block_stages "
            f"({num_block_stages}); every block stage must hold the same number of blocks"
        )
    if not 0 <= stage <= num_block_stages:
        raise ValueError(f"stage must be in 0..{num_block_stages}, got {stage}")
    if stage == 0:
        return range(0, 0)
    per_stage = cfg.num_blocks // num_block_stages
    return range((stage - 1) * per_stage, stage * per_stage)


def stage_shapes(cfg: ModelConfig, num_block_stages: int, stage: int) -> dict[str, torch.Size]:
    """Parameter names and shapes of a stage, as its ``state_dict`` has them, without
    allocating it (meta device)."""
    blocks = stage_blocks(cfg, num_block_stages, stage)
    with torch.device("meta"):
        if stage == 0:
            return {k: v.shape for k, v in HeadStage(cfg).state_dict().items()}
        block = Block(cfg).state_dict()
    return {f"blocks.{i}.{k}": v.shape for i in range(len(blocks)) for k, v in block.items()}


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position tables (RoFormer, section 3.4), cached in fp32 once per device.

    The tables are neither parameters nor buffers, so they stay fp32 when the module is cast
    to bf16 and never appear in a state_dict.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def forward(self, seq_len: int, device: torch.device, start: int = 0) -> tuple[Tensor, Tensor]:
        """``cos, sin`` of positions ``start .. start + seq_len - 1``, shape
        ``[seq_len, head_dim]``, in fp32."""
        if start + seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {start + seq_len} exceeds max_seq_len {self.max_seq_len}"
            )
        if device not in self._tables:
            # Plain tensors even when first called under inference_mode, so a later
            # training step can save them for backward; fp32 whatever autocast says.
            with torch.inference_mode(False), torch.no_grad():
                half = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
                inv_freq = 1.0 / (self.theta ** (half / self.head_dim))
                pos = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
                angles = pos[:, None] * inv_freq[None, :]
                angles = torch.cat([angles, angles], dim=-1)
                self._tables[device] = (angles.cos(), angles.sin())
        cos, sin = self._tables[device]
        return cos[start : start + seq_len], sin[start : start + seq_len]


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``[B, H, T, hd]`` (rotate-half layout), in fp32."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class LayerCache:
    """One block's keys and values ``[B, H, T, hd]`` of the positions seen so far, in buffers
    of ``max_seq_len`` positions allocated on first use (appending never copies the past)."""

    def __init__(self, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len
        self.length = 0
        self._k: Tensor | None = None
        self._v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new positions' ``k, v``; return the keys and values of every position."""
        end = self.length + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"the KV cache holds at most {self.max_seq_len} positions, not {end}")
        if self._k is None or self._v is None or self._k.shape[:2] != k.shape[:2]:
            if self.length:
                raise ValueError("a KV cache cannot change batch size or heads midway")
            shape = (*k.shape[:2], self.max_seq_len, k.shape[3])
            self._k = k.new_empty(shape)
            self._v = v.new_empty(shape)
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]


class KVCache:
    """Keys and values of every block for the positions a ``FullModel`` has seen."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.layers = [LayerCache(cfg.max_seq_len) for _ in range(cfg.num_blocks)]

    @property
    def length(self) -> int:
        """Positions seen so far (the position of the next token)."""
        return self.layers[0].length


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE on queries and keys.

    With ``observe`` set, a forward also records ``max_logit``, the largest pre-softmax
    attention score it computed (a YaLM thermometer: runaway logits precede divergence). The
    fused kernel never materialises the scores, so that costs one more ``q @ k^T``: the
    runner asks for it on a sample of forwards only."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.observe = False
        self.max_logit = 0.0
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None
    ) -> Tensor:
        """``x`` ``[B, T, D]``; with ``cache``, ``x`` holds the positions after those cached,
        which it attends to as well (``cos, sin`` must be those of the new positions)."""
        batch, seq_len, d_model = x.shape
        shape = (batch, seq_len, self.num_heads, self.head_dim)
        q = self.wq(x).view(shape).transpose(1, 2)
        k = self.wk(x).view(shape).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        if self.observe and past == 0:
            self.max_logit = _max_causal_logit(q, k)
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif seq_len == 1:  # one new position: it may see every cached one
            out = F.scaled_dot_product_attention(q, k, v)
        else:  # new position i sees positions 0 .. past + i (is_causal aligns top-left)
            allowed = torch.ones(seq_len, past + seq_len, dtype=torch.bool, device=x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.tril(past))
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, d_model))


def _max_causal_logit(q: Tensor, k: Tensor) -> float:
    """The largest ``q . k / sqrt(head_dim)`` over the causal (lower) triangle."""
    with torch.no_grad():
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        seq_len = scores.shape[-1]
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        return float(scores.masked_fill(future, -math.inf).amax())


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm transformer block: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None
    ) -> Tensor:
        # The residual stream keeps its own dtype (fp32 under autocast), per YaLM.
        h = h + self.attn(self.attn_norm(h), cos, sin, cache).to(h.dtype)
        return h + self.mlp(self.mlp_norm(h)).to(h.dtype)


# Weights whose init is scaled down by 1/sqrt(2 * num_blocks) (GPT-2 style residual scaling).
_OUTPUT_PROJECTIONS = ("attn.wo.weight", "mlp.w2.weight")


class HeadStage(nn.Module):
    """Stage 0: token embedding, embedding norm (unless ``cfg.embed_norm`` is off: then no
    such parameter), final norm, LM head and the loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Its table is left unset, as every caller builds this on the meta device and then
        # fills it (``_init_`` or a state dict): torch's own draw, ``normal_`` on the meta
        # device, would import the compiler (``node.stage.adam`` says what that costs).
        table = torch.empty(cfg.vocab_size, cfg.d_model)
        self.tok_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=table)
        self.embed_norm: nn.Module = (
            RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.embed_norm else nn.Identity()
        )
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embed(self, ids: Tensor) -> Tensor:
        """Token ids ``[B, T]`` to hidden states ``[B, T, D]``."""
        return self.embed_norm(self.tok_embedding(ids))

    def logits(self, h: Tensor) -> Tensor:
        """Hidden states ``[B, T, D]`` after the last block to logits ``[B, T, V]``."""
        return self.lm_head(self.final_norm(h))

    def loss(self, h: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy over all tokens, in fp32."""
        logits = self.logits(h).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


class BlockStage(nn.Module):
    """A block stage: consecutive blocks, named ``blocks.0 ..`` whatever their global index."""

    def __init__(self, cfg: ModelConfig, first_block: int, blocks: Sequence[Block]) -> None:
        super().__init__()
        assert len(blocks) > 0 and first_block + len(blocks) <= cfg.num_blocks
        self.cfg = cfg
        self.first_block = first_block
        self.blocks = nn.ModuleList(blocks)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, h: Tensor) -> Tensor:
        cos, sin = self.rotary(h.shape[1], h.device)
        for block in self.blocks:
            h = block(h, cos, sin)
        return h


class FullModel(nn.Module):
    """The whole model, a head stage plus all blocks, for offline eval, tests and generation."""

    def __init__(self, head: HeadStage, blocks: Sequence[Block]) -> None:
        super().__init__()
        assert len(blocks) == head.cfg.num_blocks
        self.cfg = head.cfg
        self.head = head
        self.blocks = nn.ModuleList(blocks)
        self.rotary = Rotary(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)

    def hidden(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """Hidden states after the last block, ``[B, T, D]``; with ``cache``, ``ids`` are the
        positions after those cached, and the cache takes theirs."""
        h = self.head.embed(ids)
        start = 0 if cache is None else cache.length
        cos, sin = self.rotary(ids.shape[1], h.device, start)
        layers = [None] * len(self.blocks) if cache is None else cache.layers
        for block, layer in zip(self.blocks, layers, strict=True):
            h = block(h, cos, sin, layer)
        return h

    def forward(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """Token ids ``[B, T]`` to logits ``[B, T, V]`` (with ``cache``: see ``hidden``)."""
        return self.head.logits(self.hidden(ids, cache))

    def loss(self, ids: Tensor, labels: Tensor) -> Tensor:
        return self.head.loss(self.hidden(ids), labels)


def _derived_seed(seed: int, label: str | int) -> int:
    """A 63-bit seed from (swarm seed, label) via sha256, identical in every process."""
    digest = hashlib.sha256(json.dumps([seed, label]).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


@torch.no_grad()
def _init_(module: nn.Module, cfg: ModelConfig, generator: torch.Generator) -> None:
    """Initialise every parameter of ``module`` in registration order from ``generator``."""
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_blocks)
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(_OUTPUT_PROJECTIONS):
            param.normal_(0.0, out_std, generator=generator)
        else:
            param.normal_(0.0, cfg.init_std, generator=generator)


def _build_head(cfg: ModelConfig, seed: int) -> HeadStage:
    # Built on the meta device first so nothing draws from torch's global RNG.
    with torch.device("meta"):
        head = HeadStage(cfg)
    head.to_empty(device="cpu")
    _init_(head, cfg, torch.Generator().manual_seed(_derived_seed(seed, "head")))
    return head


def _build_block(cfg: ModelConfig, seed: int, index: int) -> Block:
    with torch.device("meta"):
        block = Block(cfg)
    block.to_empty(device="cpu")
    _init_(block, cfg, torch.Generator().manual_seed(_derived_seed(seed, index)))
    return block


def build_stage(
    cfg: ModelConfig, num_block_stages: int, stage: int, seed: int
) -> HeadStage | BlockStage:
    """Stage ``stage`` of ``1 + num_block_stages``, initialised on CPU from the swarm seed.

    Each block draws from its own generator seeded by (seed, global block index) and the head
    from (seed, "head"), so a stage built alone equals the same part of ``build_model``.
    """
    blocks = stage_blocks(cfg, num_block_stages, stage)
    if stage == 0:
        return _build_head(cfg, seed)
    return BlockStage(cfg, blocks.start, [_build_block(cfg, seed, i) for i in blocks])


def build_model(cfg: ModelConfig, seed: int) -> FullModel:
    """The whole model on CPU, initialised exactly as the stages of ``build_stage``."""
    head = _build_head(cfg, seed)
    return FullModel(head, [_build_block(cfg, seed, i) for i in range(cfg.num_blocks)])


def compose_stages(head: HeadStage, block_stages: Sequence[BlockStage]) -> FullModel:
    """A ``FullModel`` sharing (not copying) the parameters of ``head`` and ``block_stages``."""
    blocks: list[Block] = []
    for block_stage in block_stages:
        if block_stage.cfg != head.cfg:
            raise ValueError("block stages and head stage were built from different configs")
        if block_stage.first_block != len(blocks):
            raise ValueError(
                f"block stages must be given in order and cover every block: expected a stage "
                f"starting at block {len(blocks)}, got one starting at {block_stage.first_block}"
            )
        blocks.extend(cast(Sequence[Block], block_stage.blocks))
    if len(blocks) != head.cfg.num_blocks:
        raise ValueError(f"block stages hold {len(blocks)} blocks, expected {head.cfg.num_blocks}")
    return FullModel(head, blocks)


def model_fingerprint(cfg: ModelConfig, num_block_stages: int, seed: int) -> str:
    """16 hex chars identifying (architecture, cfg, N, seed); identical across processes."""
    stage_blocks(cfg, num_block_stages, 0)  # validates the split
    canonical = json.dumps(
        {
            "architecture": ARCHITECTURE_VERSION,
            "config": asdict(cfg),
            "num_block_stages": num_block_stages,
            "seed": seed,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
