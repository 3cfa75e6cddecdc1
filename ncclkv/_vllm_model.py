"""A tiny random Llama checkpoint that vLLM can load, built locally (no download).

Used by the real-vLLM tests and by ``ncclkv demo``. The weights are random but
fixed by a seed, so every build of one spec gives the same greedy outputs. The
default initialiser scale is larger than a trained model's (0.2, not 0.02):
with 0.02 the logits are nearly tied and greedy decoding repeats a few tokens,
which would let a broken KV transfer go unnoticed.

transformers is imported only inside :func:`build_tiny_llama` (vLLM pulls it
in), so importing this module costs nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["MLA_ENGINE_OPTIONS", "TinyLlamaSpec", "build_eagle_head", "build_tiny_deepseek", "build_tiny_llama",
           "eagle_speculative_config", "MARKER_FILE"]

# Written last, after the weights: its presence with an equal spec means done.
MARKER_FILE = "ncclkv_tiny_model.json"

# Head sizes the vLLM CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py).
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """Shape and seed of a tiny Llama; equal specs give byte-equal weights."""

    num_layers: int = 2
    num_kv_heads: int = 4
    head_size: int = 64
    num_heads: int = 8
    vocab_size: int = 512
    intermediate_size: int = 1024
    max_model_len: int = 1024
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "num_heads",
                     "vocab_size", "intermediate_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TinyLlamaSpec.{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_size not in _CPU_HEAD_SIZES:
            raise ValueError(
                f"head_size={self.head_size} is not supported by vLLM's CPU backend "
                f"(one of {_CPU_HEAD_SIZES})"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {_DTYPES}")
        if not self.init_std > 0:
            raise ValueError(f"init_std={self.init_std!r} must be > 0")

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def build_tiny_llama(
    out_dir: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    num_kv_heads: int = 4,
    head_size: int = 64,
    num_heads: int = 8,
    vocab_size: int = 512,
    intermediate_size: int = 1024,
    max_model_len: int = 1024,
    dtype: str = "float32",
    seed: int = 0,
    init_std: float = 0.2,
) -> Path:
    """Write a random Llama checkpoint to ``out_dir`` and return its path.

    Idempotent: when ``out_dir`` already holds a build of the same spec it is
    returned untouched. A build of another spec is replaced. A non-empty
    directory that is not one of our builds is refused (ValueError) rather
    than overwritten. Concurrent callers are safe: each builds in a private
    temporary sibling and the first to finish renames it into place.
    """
    spec = TinyLlamaSpec(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size,
        num_heads=num_heads, vocab_size=vocab_size, intermediate_size=intermediate_size,
        max_model_len=max_model_len, dtype=dtype, seed=seed, init_std=init_std,
    )
    out = Path(out_dir).resolve()
    found = _read_marker(out)
    if found == spec.to_json():
        return out
    if out.exists() and any(out.iterdir()):
        if found is None:
            raise ValueError(f"{out} is not empty and holds no tiny-model build; refusing to overwrite it "
                             "(give ncclkv demo another --model-dir)")
        shutil.rmtree(out)  # our own build of another spec
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is not
        _write_checkpoint(spec, tmp)
        try:
            if out.exists():
                out.rmdir()  # empty directory left by the caller
            os.rename(tmp, out)
        except OSError:
            # Another process won the race; keep its build if it is ours.
            if _read_marker(out) != spec.to_json():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _read_marker(out: Path) -> str | None:
    try:
        text = (out / MARKER_FILE).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return json.dumps(json.loads(text), sort_keys=True)


def _write_checkpoint(spec: TinyLlamaSpec, out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        max_position_embeddings=spec.max_model_len,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    _save_random(LlamaForCausalLM, config, spec.dtype, spec.seed, out)
    (out / MARKER_FILE).write_text(spec.to_json())


def build_eagle_head(model_dir: Path, out_dir: Path, seed: int = 7) -> Path:
    """A random EAGLE drafter (one decoder layer and the ``fc`` that joins embedding and hidden state) for the
    model at ``model_dir``, in the checkpoint layout vLLM's ``EagleLlamaForCausalLM`` loads; it shares the
    model's ``lm_head``. Its drafts are poor, which speculative decoding's verification makes harmless: the
    outputs are the model's. Rebuilt on every call (a few MiB)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "embed_tokens.weight": (config["vocab_size"], hidden),
        "fc.weight": (hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": (q_size, hidden),
        "layers.0.self_attn.k_proj.weight": (kv_size, hidden),
        "layers.0.self_attn.v_proj.weight": (kv_size, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, q_size),
        "layers.0.mlp.gate_proj.weight": (inner, hidden),
        "layers.0.mlp.up_proj.weight": (inner, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inner),
    }
    dtype = getattr(torch, config.get("dtype", "float32"))
    generator = torch.Generator().manual_seed(seed)
    weights = {name: (torch.randn(shape, generator=generator) * 0.02).to(dtype) for name, shape in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def eagle_speculative_config(model_dir: Path, out_dir: Path, num_speculative_tokens: int = 2) -> dict[str, object]:
    """vLLM's ``speculative_config`` for a :func:`build_eagle_head` drafter (built into ``out_dir``)."""
    head = build_eagle_head(model_dir, out_dir)
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": num_speculative_tokens}


# vLLM 0.32's LLM arguments for an MLA model on the CPU: its reference MLA backend (the AMX one needs blocks of
# 32 and keeps chunked prefill on) and the rotary embedding in torch: the CPU op rotates MLA's strided 3-d query
# wrongly (only its first rows, at positions 0..T-1), so outputs would change with how a prompt's prefill is
# split, a KV load included.
MLA_ENGINE_OPTIONS: dict[str, object] = {"attention_config": {"backend": "CPU_MLA"},
                                         "compilation_config": {"custom_ops": ["-rotary_embedding"]}}


def build_tiny_deepseek(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V2 (MLA attention: a 512-dim latent and a 64-dim rotary key per token and layer,
    the only shape vLLM's CPU MLA kernel takes; 2 dense layers, bfloat16), written to ``out_dir`` on every
    call (a few MiB). Serve it with :data:`MLA_ENGINE_OPTIONS` and blocks of 16."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=4096, initializer_range=0.2, rms_norm_eps=1e-6,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        # Every layer dense (first_k_dense_replace = the layer count): the MoE sizes are never used.
        first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=128, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    out = Path(out_dir)
    _save_random(DeepseekV2ForCausalLM, config, "bfloat16", seed, out)
    return out


def _save_random(model_class: Any, config: Any, dtype: str, seed: int, out: Path) -> None:
    """``model_class(config)`` with weights drawn from ``seed``, in ``dtype``, saved to ``out`` as vLLM loads it."""
    import torch
    from transformers import GenerationConfig

    # Fork the RNG so building never disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(out)
    # No sampling defaults from a generation config; tests set their own.
    GenerationConfig(bos_token_id=0, eos_token_id=1).save_pretrained(out)
