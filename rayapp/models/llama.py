"""The Llama-family forward (Llama, SmolLM2, Qwen2, Qwen3) over a flat batch of tokens.

The model knows nothing about pages or requests: each layer hands its q, k, v to an
`Attention` callable that the engine supplies, which stores K/V wherever the engine keeps them
and returns the attention output. Numerics follow Hugging Face's implementation op for op
(RMSNorm in float32, rotate-half RoPE from a float32 table) so greedy outputs match it.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rayapp.kernels.linear import prepack_linears
from rayapp.models.loader import ModelSpec


class Attention(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""


def rope_inv_freq(spec: ModelSpec) -> Tensor:
    """Inverse frequencies of RoPE with the config's scaling (default, linear or llama3)."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported; rayapp supports default, linear and llama3")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # Qwen3: one RMSNorm over head_dim, shared by the heads, on queries and keys before RoPE.
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, index: int, h: Tensor, cos: Tensor, sin: Tensor, attention: Attention) -> Tensor:
        # h: [T, hidden]; cos/sin: [T, 1, D]
        t = h.shape[0]
        q, k, v = self.qkv_proj(self.input_layernorm(h)).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        h = h + self.o_proj(attention(index, q, k, v).reshape(t, -1))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 decoder. `forward` takes a flat batch: all scheduled tokens of all sequences."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.cos_table = self.sin_table = torch.empty(0)

    def forward(self, input_ids: Tensor, positions: Tensor, attention: Attention) -> Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)
        # The table is float32 like Hugging Face's; cast to the activations' dtype as it does.
        cos = self.cos_table[positions].to(h.dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(h.dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            h = layer(i, h, cos, sin, attention)
        return self.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state: dict[str, Tensor]) -> None:
        """Take Hugging Face tensors (already in the target dtype and device) into the fused layout.

        The model may be built on the meta device: the tensors are assigned, not copied.
        """
        own: dict[str, Tensor] = {
            "embed_tokens.weight": state["model.embed_tokens.weight"],
            "norm.weight": state["model.norm.weight"],
            "lm_head.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"]),
        }
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            own[f"layers.{i}.qkv_proj.weight"] = torch.cat([state[attn + f"{x}_proj.weight"] for x in "qkv"])
            if self.spec.attention_bias:
                own[f"layers.{i}.qkv_proj.bias"] = torch.cat([state[attn + f"{x}_proj.bias"] for x in "qkv"])
            own[f"layers.{i}.o_proj.weight"] = state[attn + "o_proj.weight"]
            gate_up = [state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]]
            own[f"layers.{i}.gate_up_proj.weight"] = torch.cat(gate_up)
            own[f"layers.{i}.down_proj.weight"] = state[mlp + "down_proj.weight"]
            own[f"layers.{i}.input_layernorm.weight"] = state[p + "input_layernorm.weight"]
            own[f"layers.{i}.post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
            if self.spec.qk_norm:
                own[f"layers.{i}.q_norm.weight"] = state[attn + "q_norm.weight"]
                own[f"layers.{i}.k_norm.weight"] = state[attn + "k_norm.weight"]
        self.load_state_dict(own, strict=True, assign=True)
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        device = self.embed_tokens.weight.device
        freqs = torch.outer(torch.arange(self.spec.max_position_embeddings).float(), rope_inv_freq(self.spec))
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        self.cos_table, self.sin_table = emb.cos(), emb.sin()


def load_model(spec: ModelSpec, state: dict[str, Tensor], prepack: bool = True) -> LlamaForCausalLM:
    """Build the model without initializing weights and take `state`'s tensors; with `prepack`, the
    projections this CPU can pack move to oneDNN's layout (`rayapp.kernels.cpu` decides which)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(spec)
    model.load_hf_state_dict(state)
    if prepack:
        prepack_linears(model)
    return model.eval()
