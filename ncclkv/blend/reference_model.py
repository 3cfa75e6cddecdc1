"""A tiny Llama-like model in plain torch, for tests and benchmarks of CacheBlend only.

Not a serving model: random weights from a fixed seed, float32 by default, no
KV cache for decoding, no vLLM. It has what CacheBlend touches: RoPE, GQA,
RMSNorm, a SwiGLU MLP, several layers, and batches of requests packed along
tokens with ``query_start_loc``. It runs a full prefill (every layer's K/V and
the final hidden states) and a CacheBlend prefill that asks a
:class:`BlendRetrieverTask` and a :class:`BlendExecutor` at every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ._executor import BlendExecutor
from ._retriever import BlendRetrieverTask
from ._rope import RopeSpec, apply_rope

__all__ = ["BlendPrefill", "Prefill", "TinyLlama", "TinyLlamaConfig"]


@dataclass(frozen=True, slots=True)
class TinyLlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    intermediate_size: int = 128
    rope: RopeSpec = field(default_factory=RopeSpec)
    rms_eps: float = 1e-6
    qk_gain: float = 1.0  # scales W_q, W_k: > 1 sharpens attention (and makes the random model chaotic)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.rope.dim_for(self.head_size)


@dataclass(frozen=True, slots=True, eq=False)
class Prefill:
    """A full prefill: final hidden states ``[num_tokens, hidden]`` and K/V per layer."""

    hidden: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]


@dataclass(frozen=True, slots=True, eq=False)
class BlendPrefill:
    """A CacheBlend prefill: hidden states of the computed tokens only, which tokens those
    are (``token_indices`` into the batch), their ``query_start_loc``, and each layer's
    blended long K/V (what a KV cache would keep)."""

    hidden: torch.Tensor
    token_indices: torch.Tensor
    query_start_loc: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]


@dataclass(frozen=True, slots=True, eq=False)
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class TinyLlama:
    """See the module docstring. Token ids are a 1-D tensor of the batch's packed prompts."""

    def __init__(self, config: TinyLlamaConfig | None = None, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.config = cfg = TinyLlamaConfig() if config is None else config
        gen = torch.Generator().manual_seed(cfg.seed)

        def weight(fan_in: int, fan_out: int, gain: float = 1.0) -> torch.Tensor:
            w = torch.randn(fan_in, fan_out, generator=gen) * (gain / math.sqrt(fan_in))
            return w.to(device=device, dtype=dtype)

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(cfg.hidden_size, generator=gen)).to(device=device, dtype=dtype)

        hidden, q_size, kv_size = cfg.hidden_size, cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
        self.embed = torch.randn(cfg.vocab_size, hidden, generator=gen).to(device=device, dtype=dtype)
        self.layers = [
            _Layer(norm(), weight(hidden, q_size, cfg.qk_gain), weight(hidden, kv_size, cfg.qk_gain),
                   weight(hidden, kv_size), weight(q_size, hidden), norm(),
                   weight(hidden, cfg.intermediate_size), weight(hidden, cfg.intermediate_size),
                   weight(cfg.intermediate_size, hidden))
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = norm()

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, query_start_loc: torch.Tensor | None = None) -> Prefill:
        """Every layer for every token (causal within each request)."""
        qsl = _default_qsl(token_ids, query_start_loc)
        positions = _positions(qsl).to(token_ids.device)
        h = self.embed[token_ids]
        ks, vs = [], []
        for layer in self.layers:
            q, k, v = self._qkv(layer, h, positions)
            ks.append(k)
            vs.append(v)
            h = self._finish(layer, h, self._attend(q, k, v, positions, positions, qsl, qsl))
        return Prefill(self._rms(h, self.final_norm), ks, vs)

    @torch.inference_mode()
    def blend_prefill(self, token_ids: torch.Tensor, task: BlendRetrieverTask, executor: BlendExecutor) -> BlendPrefill:
        """The prefill with CacheBlend: each layer's K/V blended, later layers on fewer tokens."""
        full_qsl = task.query_start_loc
        full_positions = task.positions.to(token_ids.device)
        if token_ids.shape != (task.num_tokens,):
            raise ValueError(f"token_ids {tuple(token_ids.shape)} do not match the task's {task.num_tokens} tokens")
        h = self.embed[token_ids]
        positions, qsl = full_positions, full_qsl
        token_indices = torch.arange(task.num_tokens, device=token_ids.device)
        ks, vs = [], []
        for layer_id, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, positions)
            got = task.result(layer_id)
            out = executor.blend(layer_id, got.k, got.v, got.valid_mask, got.original_positions,
                                 q, k, v, positions, qsl, token_dim=0)
            ks.append(out.k)
            vs.append(out.v)
            if out.local_indices.numel() != h.shape[0]:  # else all rows are kept, in order
                h, token_indices = h[out.local_indices], token_indices[out.local_indices]
            if out.query_start_loc is not None:
                qsl = out.query_start_loc.cpu()
            positions = out.positions
            attn = self._attend(out.q, out.k, out.v, positions, full_positions, qsl, full_qsl)
            h = self._finish(layer, h, attn)
        return BlendPrefill(self._rms(h, self.final_norm), token_indices, qsl, ks, vs)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_eps) * weight

    def _qkv(self, layer: _Layer, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.config
        x = self._rms(h, layer.attn_norm)
        q = (x @ layer.wq).view(-1, cfg.num_heads, cfg.head_size)
        k = (x @ layer.wk).view(-1, cfg.num_kv_heads, cfg.head_size)
        v = (x @ layer.wv).view(-1, cfg.num_kv_heads, cfg.head_size)
        return apply_rope(q, positions, cfg.rope), apply_rope(k, positions, cfg.rope), v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                k_positions: torch.Tensor, q_qsl: torch.Tensor, k_qsl: torch.Tensor) -> torch.Tensor:
        """Causal attention per request: a query sees the keys of its request at positions <= its own."""
        group = self.config.num_heads // self.config.num_kv_heads
        out = torch.empty_like(q)
        q_bounds, k_bounds = q_qsl.tolist(), k_qsl.tolist()
        for qa, qb, ka, kb in zip(q_bounds, q_bounds[1:], k_bounds, k_bounds[1:]):
            if qb == qa:
                continue
            mask = k_positions[ka:kb][None, :] <= q_positions[qa:qb][:, None]
            kr = k[ka:kb].repeat_interleave(group, dim=1).transpose(0, 1)
            vr = v[ka:kb].repeat_interleave(group, dim=1).transpose(0, 1)
            heads_first = F.scaled_dot_product_attention(q[qa:qb].transpose(0, 1), kr, vr, attn_mask=mask)
            out[qa:qb] = heads_first.transpose(0, 1)
        return out.flatten(1)

    def _finish(self, layer: _Layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = h + attn @ layer.wo
        x = self._rms(h, layer.mlp_norm)
        return h + (F.silu(x @ layer.w_gate) * (x @ layer.w_up)) @ layer.w_down


def _default_qsl(token_ids: torch.Tensor, query_start_loc: torch.Tensor | None) -> torch.Tensor:
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D (packed requests), got shape {tuple(token_ids.shape)}")
    if query_start_loc is None:
        return torch.tensor([0, token_ids.numel()], dtype=torch.int64)
    return query_start_loc.to("cpu", torch.int64)


def _positions(qsl: torch.Tensor) -> torch.Tensor:
    bounds = qsl.tolist()
    return torch.cat([torch.arange(b - a, dtype=torch.int64) for a, b in zip(bounds, bounds[1:])])
