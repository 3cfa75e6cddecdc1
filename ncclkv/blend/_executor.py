"""The blend executor: pick the tokens to recompute, and merge fresh with retrieved KV.

One executor serves one forward pass of a batch, layer by layer:

* ``layer < check_layer``: full compute. The output is the fresh Q/K/V of
  every token; retrieved KV is ignored.
* ``layer == check_layer``: fresh Q/K/V of every token come in. Retrieved K is
  re-rotated to the new positions and compared with fresh K; the tokens to
  recompute are chosen (:func:`select_tokens`) and remembered. The output is the
  short Q of those tokens and the long K/V: retrieved, with fresh values written
  over the chosen tokens.
* ``layer > check_layer``: the caller computed Q/K/V for the chosen tokens only
  (its hidden states are the short ones), in the order and with the positions and
  ``query_start_loc`` the check layer returned. The output is the same Q and the
  long K/V blended as above.

A new pass starts at any layer before the check layer (or with :meth:`reset`).
"""

from __future__ import annotations

import torch

from ._rope import check_heads, rope_cos_sin, rotate
from ._select import check_query_start_loc, select_tokens
from ._types import BlendConfig, BlendOutput

__all__ = ["BlendExecutor"]


class BlendExecutor:
    """CacheBlend's executor (the seed's ``BlendExecutor``), see the module docstring."""

    def __init__(self, config: BlendConfig | None = None) -> None:
        self._config = BlendConfig() if config is None else config
        if not isinstance(self._config, BlendConfig):
            raise TypeError(f"config must be a BlendConfig, got {type(self._config).__name__}")
        self._token_dim = 0  # the last blend()'s, for its errors
        self.reset()

    @property
    def config(self) -> BlendConfig:
        return self._config

    @property
    def selected_indices(self) -> torch.Tensor | None:
        """Indices of the recomputed tokens in the long sequence, once the check layer ran."""
        return self._selected

    def reset(self) -> None:
        """Forget the selection (the next pass must run its check layer again)."""
        self._selected: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None  # new positions of every token
        self._short_qsl: torch.Tensor | None = None
        self._angles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (original_positions, cos, sin)

    def blend(
        self,
        layer_id: int,
        retrieved_k: torch.Tensor | None,
        retrieved_v: torch.Tensor | None,
        valid_mask: torch.Tensor,
        original_positions: torch.Tensor,
        fresh_q: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        positions: torch.Tensor,
        query_start_loc: torch.Tensor,
        token_dim: int = 0,
    ) -> BlendOutput:
        """Blend one layer. Q/K/V are 3-D, tokens on ``token_dim`` (0 or 1) and head channels last:
        ``[num_tokens, num_heads, head_size]`` for ``token_dim=0``. A flat ``[num_tokens, num_heads *
        head_size]`` (vLLM's qkv split) is refused: the caller knows the head size, viewing it is exact."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise ValueError(f"layer_id must be an int >= 0, got {layer_id!r}")
        if isinstance(token_dim, bool) or token_dim not in (0, 1):
            raise ValueError(f"layer {layer_id}: token_dim must be 0 or 1 (3-D tensors, head channels last), "
                             f"got {token_dim!r}")
        for name, t in (("fresh_q", fresh_q), ("fresh_k", fresh_k), ("fresh_v", fresh_v),
                        ("retrieved_k", retrieved_k), ("retrieved_v", retrieved_v)):
            if t is not None:
                check_heads(f"layer {layer_id}: {name}", t)
        q, k, v = (t.movedim(token_dim, 0) for t in (fresh_q, fresh_k, fresh_v))
        if retrieved_k is not None and retrieved_v is not None:
            retrieved_k, retrieved_v = retrieved_k.movedim(token_dim, 0), retrieved_v.movedim(token_dim, 0)
        elif retrieved_k is not None or retrieved_v is not None:
            raise ValueError("retrieved_k and retrieved_v must both be tensors or both be None")
        self._token_dim = token_dim  # for errors: shapes as the caller passed them
        _check_fresh(layer_id, q, k, v, positions, token_dim)
        positions = positions.to(k.device)
        check = self._config.check_layer
        if layer_id < check:
            self.reset()
            check_query_start_loc(query_start_loc, q.shape[0], f"layer {layer_id}")
            local = torch.arange(q.shape[0], device=q.device)
            out = BlendOutput(q, k, v, positions, local, None)
        elif layer_id == check:
            out = self._select(layer_id, retrieved_k, retrieved_v, valid_mask, original_positions,
                               q, k, v, positions, query_start_loc)
        else:
            out = self._reuse(layer_id, retrieved_k, retrieved_v, valid_mask, original_positions,
                              q, k, v, positions, query_start_loc)
        if token_dim == 0:
            return out
        q, k, v = (t.movedim(0, token_dim) for t in (out.q, out.k, out.v))
        return BlendOutput(q, k, v, out.positions, out.local_indices, out.query_start_loc)

    def _select(self, layer_id: int, retrieved_k: torch.Tensor | None, retrieved_v: torch.Tensor | None,
                valid_mask: torch.Tensor, original_positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor) -> BlendOutput:
        num_tokens = k.shape[0]
        bounds = check_query_start_loc(query_start_loc, num_tokens, f"check layer {layer_id}")
        valid = _check_valid(layer_id, valid_mask, original_positions, num_tokens, retrieved_k is not None)
        self._positions, self._angles = positions.to(torch.int64), None  # a new pass: new positions
        if retrieved_k is None or retrieved_v is None:
            deviation = torch.zeros(num_tokens, device=k.device)
            long_k, long_v = k.clone(), v.clone()
        else:
            long_k = self._rerotated(layer_id, retrieved_k, original_positions, k)
            long_v = _matched(layer_id, "retrieved_v", retrieved_v, v, num_tokens, copy=True,
                              token_dim=self._token_dim)
            deviation = (long_k - k).to(torch.float32).square().flatten(1).sum(1)
        selected, short_qsl = select_tokens(deviation, valid, bounds, self._config.recompute_ratio)
        self._selected, self._short_qsl = selected, short_qsl
        long_k.index_copy_(0, selected, k.index_select(0, selected))
        long_v.index_copy_(0, selected, v.index_select(0, selected))
        return BlendOutput(q.index_select(0, selected), long_k, long_v, positions.index_select(0, selected),
                           selected, short_qsl)

    def _reuse(self, layer_id: int, retrieved_k: torch.Tensor | None, retrieved_v: torch.Tensor | None,
               valid_mask: torch.Tensor, original_positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor) -> BlendOutput:
        selected, short_qsl, full_positions = self._selected, self._short_qsl, self._positions
        if selected is None or short_qsl is None or full_positions is None:
            raise ValueError(f"layer {layer_id} comes after check layer {self._config.check_layer}, "
                             "which has not run in this pass")
        if k.shape[0] != selected.numel():
            raise ValueError(f"layer {layer_id}: fresh K has {k.shape[0]} tokens, the check layer "
                             f"selected {selected.numel()}")
        if not torch.equal(query_start_loc.to(short_qsl.device, torch.int64), short_qsl):
            raise ValueError(f"layer {layer_id}: query_start_loc {query_start_loc.tolist()} is not the one "
                             f"the check layer returned, {short_qsl.tolist()}")
        num_tokens = full_positions.numel()
        valid = _check_valid(layer_id, valid_mask, original_positions, num_tokens, retrieved_k is not None)
        recomputed = torch.zeros(num_tokens, dtype=torch.bool, device=valid.device)
        recomputed[selected.to(valid.device)] = True
        if bool((~valid & ~recomputed).any()):
            first = int((~valid & ~recomputed).nonzero()[0])
            raise ValueError(f"layer {layer_id}: token {first} has no retrieved KV and was not "
                             "recomputed; the retrieved chunks changed after the check layer")
        if retrieved_k is None or retrieved_v is None:
            long_k = k.new_zeros((num_tokens,) + tuple(k.shape[1:]))
            long_v = v.new_zeros((num_tokens,) + tuple(v.shape[1:]))
        else:
            long_k = self._rerotated(layer_id, retrieved_k, original_positions, k)
            long_v = _matched(layer_id, "retrieved_v", retrieved_v, v, num_tokens, copy=True,
                              token_dim=self._token_dim)
        long_k.index_copy_(0, selected, k)
        long_v.index_copy_(0, selected, v)
        local = torch.arange(k.shape[0], device=k.device)
        return BlendOutput(q, long_k, long_v, positions, local, short_qsl)

    def _rerotated(self, layer_id: int, retrieved_k: torch.Tensor, original_positions: torch.Tensor,
                   fresh_k: torch.Tensor) -> torch.Tensor:
        """Retrieved K moved to the new positions; the angles are reused while the positions stay."""
        assert self._positions is not None
        num_tokens = self._positions.numel()
        retrieved_k = _matched(layer_id, "retrieved_k", retrieved_k, fresh_k, num_tokens, copy=False,
                               token_dim=self._token_dim)
        original = original_positions.to(device=self._positions.device, dtype=torch.int64)
        # Rotate in at least float32: bf16 angles would be off by whole degrees at long positions.
        angle_dtype = torch.promote_types(fresh_k.dtype, torch.float32)
        cached = self._angles
        if cached is None or cached[1].dtype != angle_dtype or not torch.equal(cached[0], original):
            cos, sin = rope_cos_sin(self._positions - original, self._config.rope, fresh_k.shape[-1], angle_dtype)
            cached = self._angles = (original, cos.to(fresh_k.device), sin.to(fresh_k.device))
        return rotate(retrieved_k, cached[1], cached[2], self._config.rope).to(fresh_k.dtype)


def _check_fresh(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 token_dim: int) -> None:
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"layer {layer_id}: fresh q and k differ in head_size: {_as_given(q.shape, token_dim)} "
                         f"and {_as_given(k.shape, token_dim)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0] == positions.numel()) or positions.dim() != 1:
        raise ValueError(f"layer {layer_id}: fresh q/k/v and positions disagree on the number of tokens: "
                         f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]}, positions {tuple(positions.shape)}")


def _check_valid(layer_id: int, valid_mask: torch.Tensor, original_positions: torch.Tensor, num_tokens: int,
                 have_kv: bool) -> torch.Tensor:
    if valid_mask.dtype != torch.bool or valid_mask.shape != (num_tokens,):
        raise ValueError(f"layer {layer_id}: valid_mask must be bool [{num_tokens}], got "
                         f"{valid_mask.dtype} {tuple(valid_mask.shape)}")
    if original_positions.shape != (num_tokens,):
        raise ValueError(f"layer {layer_id}: original_positions must be [{num_tokens}], got "
                         f"{tuple(original_positions.shape)}")
    if not have_kv and bool(valid_mask.any()):
        raise ValueError(f"layer {layer_id}: valid_mask marks tokens valid but no K/V was retrieved")
    return valid_mask


def _matched(layer_id: int, name: str, retrieved: torch.Tensor, fresh: torch.Tensor, num_tokens: int,
             copy: bool, token_dim: int) -> torch.Tensor:
    """``retrieved`` on fresh's device (and dtype), shape-checked; a new tensor if ``copy``."""
    if retrieved.shape[0] != num_tokens or tuple(retrieved.shape[1:]) != tuple(fresh.shape[1:]):
        raise ValueError(f"layer {layer_id}: {name} has shape {_as_given(retrieved.shape, token_dim)}, expected "
                         f"{_as_given((num_tokens,) + tuple(fresh.shape[1:]), token_dim)}")
    out = retrieved.to(device=fresh.device, dtype=fresh.dtype)
    # The caller writes into the result: never into the retriever's tensor.
    return out.clone() if copy and out.data_ptr() == retrieved.data_ptr() else out


def _as_given(shape: tuple[int, ...] | torch.Size, token_dim: int) -> tuple[int, ...]:
    """A tokens-first shape as the caller laid it out (tokens on ``token_dim``)."""
    dims = list(shape)
    dims.insert(token_dim, dims.pop(0))
    return tuple(dims)
