"""The MTP drafter (DeepSeek-V3 style), shared by training and inference.

One draft step: concatenate RMSNorm(target hidden at t) and RMSNorm(embedding of token t+1), project
2d -> d, run one decoder block (attention with its own one-layer KV, SwiGLU MLP), final RMSNorm, then
the backbone's shared lm_head. The same block is chained K times, feeding back its own output.

"Target hidden" is the backbone's last hidden state after its final norm (the input of its lm_head);
the drafter owns no embedding and no lm_head, it borrows the backbone's (tied) embedding matrix.

Indexing used throughout: for a sequence x_0..x_{L-1} with target hiddens h_0..h_{L-1} (h_t has seen
x_0..x_t), drafter entry t (t = 0..L-2) sits at position t+1 and consumes (h_t, x_{t+1}); its output
predicts x_{t+2}. A depth-k entry at index t belongs to the chain that started at index s = t-k+1:
it attends to the depth-1 entries at indices <= s (what the KV cache holds for committed tokens,
rebuilt from target hiddens) and to the depth-d entries of its own chain at s+d-1, d = 2..k. Training
uses exactly that mask, so a drafter trained here sees at inference what it saw in training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specialists.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from specialists.ops.attention import sdpa

MTP_WEIGHTS = "mtp.safetensors"
MTP_CONFIG = "mtp_config.json"


@dataclass
class MTPConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_speculative_tokens: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    depth_loss_decay: float = 0.8

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def save(self, directory: Path) -> None:
        (Path(directory) / MTP_CONFIG).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "MTPConfig":
        return cls(**json.loads((Path(directory) / MTP_CONFIG).read_text()))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., d]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the full head dim. x: [B, H, T, hd]; positions: [T] or [B, T]."""
    cos, sin = rope_cos_sin(positions, rope_inv_freq(theta, x.shape[-1], x.device), x.dtype)  # [..., T, hd]
    if cos.dim() == 3:  # [B, T, hd] -> [B, 1, T, hd]
        cos, sin = cos[:, None], sin[:, None]
    return apply_rope(x, cos, sin)


class DraftBlock(nn.Module):
    """Pre-norm decoder block: GQA attention with RoPE, SwiGLU MLP."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [B, T, d] (block input, pre-norm) -> q [B, H, T, hd], k and v [B, Hkv, T, hd]."""
        b, t, _ = x.shape
        cfg = self.cfg
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        return rotary(q, positions, cfg.rope_theta), rotary(k, positions, cfg.rope_theta), v

    def finish(
        self,
        x: torch.Tensor,  # [B, T, d] block input
        q: torch.Tensor,  # [B, H, T, hd]
        k: torch.Tensor,  # [B, Hkv, S, hd] every key this query may see (mask decides)
        v: torch.Tensor,  # [B, Hkv, S, hd]
        mask: torch.Tensor | None,  # [T, S] or [B, 1, T, S] bool, True = may attend
    ) -> torch.Tensor:  # [B, T, d] block output
        b, _, t, _ = q.shape
        groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        attn = sdpa(q, k, v, attn_mask=mask)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def chain_mask(length: int, depth: int, device: torch.device) -> torch.Tensor:
    """[T, depth*T] bool: which entries a depth-`depth` query at index t may attend to.

    Columns are [depth-1 entries | depth-2 entries | ... | depth-`depth` entries], T each.
    Depth 1: j <= t - depth + 1. Depth d >= 2: exactly j == t - depth + d (its own chain).
    """
    t = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    blocks = [j <= t - depth + 1]
    blocks += [j == t - depth + d for d in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


class MTPDrafter(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = DraftBlock(cfg)
        self.final_norm = RMSNorm(d, cfg.rms_norm_eps)

    def fuse(self, prev: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """prev: [B, T, d] hidden to continue from; token_emb: [B, T, d] -> block input [B, T, d]."""
        return self.proj(torch.cat([self.hidden_norm(prev), self.embed_norm(token_emb)], dim=-1))

    def logits(self, out: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """out: [..., d] block output -> [..., V] through the final norm and the shared lm_head."""
        return F.linear(self.final_norm(out), lm_head_weight)

    def forward_chains(
        self,
        hidden: torch.Tensor,  # [B, L, d] target hiddens (after the backbone's final norm)
        tokens: torch.Tensor,  # [B, L] token ids the hiddens were computed on
        embed_weight: torch.Tensor,  # [V, d] the backbone's input embedding
        depths: int,
    ) -> list[torch.Tensor]:  # depths x [B, L-1, d]: depth k's output at every index t
        """All chains of `depths` steps at once, teacher-forced on `tokens` (see module docstring).

        When the first k-1 drafts of a chain equal the tokens, the depth-k output here equals what
        chained drafting produces at inference, which is what acceptance measurements need.
        """
        b, length, _ = hidden.shape
        t = length - 1
        emb = F.embedding(tokens[:, 1:], embed_weight)  # [B, T, d] token x_{t+1}
        positions = torch.arange(1, length, device=hidden.device)
        prev = hidden[:, :-1]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for depth in range(1, depths + 1):
            x = self.fuse(prev, emb)
            q, k, v = self.block.qkv(x, positions)
            keys.append(k)
            values.append(v)
            mask = chain_mask(t, depth, hidden.device)
            out = self.block.finish(x, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
            outs.append(out)
            prev = F.pad(out[:, :-1], (0, 0, 1, 0))  # depth k at t-1 feeds depth k+1 at t
        return outs


def depth_weights(cfg: MTPConfig, depths: int) -> list[float]:
    """Decaying loss weights for depths 1..K, normalized to sum to 1."""
    raw = [cfg.depth_loss_decay**k for k in range(depths)]
    return [w / sum(raw) for w in raw]


def save_drafter(drafter: MTPDrafter, directory: Path, dtype: torch.dtype | None = None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(directory / MTP_WEIGHTS), metadata={"format": "pt", "kind": "cantata-mtp"})
    drafter.cfg.save(directory)


class MissingDrafterError(FileNotFoundError):
    """The checkpoint directory has no trained MTP drafter (lesson 1: never draft with untrained heads)."""


def load_drafter(directory: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> MTPDrafter:
    directory = Path(directory)
    if not (directory / MTP_WEIGHTS).is_file() or not (directory / MTP_CONFIG).is_file():
        raise MissingDrafterError(f"{directory} has no {MTP_WEIGHTS} + {MTP_CONFIG}: train the drafter first")
    drafter = MTPDrafter(MTPConfig.load(directory))
    drafter.load_state_dict(load_file(str(directory / MTP_WEIGHTS)), strict=True)
    return drafter.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def draft_greedy(
    drafter: MTPDrafter,
    hidden: torch.Tensor,  # [L, d] target hiddens of one committed sequence
    tokens: torch.Tensor,  # [L+1] its committed tokens plus the bonus token the target just emitted
    embed_weight: torch.Tensor,  # [V, d]
    lm_head_weight: torch.Tensor,  # [V, d]
    k: int,
) -> torch.Tensor:  # [k] draft tokens d_1..d_k
    """Reference chained drafting with a dense KV (no paging): depth-1 entries for every committed
    position, then k chained steps that each append their own entry. The engine's paged version is
    tested against this."""
    length = hidden.shape[0]
    emb = F.embedding(tokens[1:], embed_weight)[None]  # [1, L, d]
    x = drafter.fuse(hidden[None], emb)
    q, keys, values = drafter.block.qkv(x, torch.arange(1, length + 1, device=hidden.device))
    prev = drafter.block.finish(x, q, keys, values, torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril())[:, -1:]
    drafts = []
    for step in range(k):
        token = drafter.logits(prev[0, -1], lm_head_weight).argmax()
        drafts.append(token)
        if step == k - 1:
            break
        x = drafter.fuse(prev, F.embedding(token.view(1, 1), embed_weight))
        q, kk, vv = drafter.block.qkv(x, torch.tensor([length + 1 + step], device=hidden.device))
        keys, values = torch.cat([keys, kk], dim=2), torch.cat([values, vv], dim=2)
        prev = drafter.block.finish(x, q, keys, values, None)
    return torch.stack(drafts)
