"""A small decoder-only transformer in torch with deterministic seeded weights (no download), split for tensor
parallelism, with a per-request KV cache and greedy / seeded temperature sampling.

Contract: ``Transformer(config, rank, world_size, all_reduce, device)`` holds rank `rank`'s shard (attention heads
and MLP columns split across ranks, embeddings and LM head replicated) on `device` ("cpu", "cuda", "cuda:N"); every
rank builds the same full weights from ``config.seed`` (on the CPU, then moved) and keeps its slice, so any world
size gives the same model. ``forward(segments)`` runs one batched step over ragged segments (new tokens of several
requests, prefill chunks and decodes mixed) and returns the logits (on the model's device) of the segments that
sample; on CUDA it only enqueues work on the current stream. A request's KV cache lives on the device until
``free(request_id)``.
Sampling is a pure function of (logits, temperature, seed, position): the same request gives the same tokens in
any batch, any wait mode and any world size (on one device: float results differ between CPU and GPU).
Temperatures below ``GREEDY_TEMPERATURE`` (1e-5) are greedy; a request whose draw fails gets a ``SampleError`` in
place of its token (the scheduler fails that request only). Draws run on the CPU; a greedy row may take its argmax
from the device that ran the step (``sample(..., argmax=)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from hotloop.engine.tokenizer import VOCAB_SIZE


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    max_seq_len: int = 1024
    vocab_size: int = VOCAB_SIZE
    seed: int = 0
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS = {
    "tiny": ModelConfig(),  # for tests: a step takes well under a millisecond of math
    "small": ModelConfig(d_model=256, n_heads=8, n_layers=4, d_ff=1024, max_seq_len=2048),  # benchmarks: ms steps
}


def model_config(name_or_config) -> ModelConfig:
    if isinstance(name_or_config, ModelConfig):
        return name_or_config
    try:
        return PRESETS[name_or_config]
    except KeyError:
        raise ValueError(f"unknown model preset {name_or_config!r}; choose one of {sorted(PRESETS)}") from None


@dataclass
class Segment:
    """New tokens of one request in a step: positions start .. start+len(token_ids)-1."""

    request_id: str
    token_ids: list[int]
    start: int
    capacity: int  # the request's most tokens (prompt + max_tokens): the KV cache allocated at its first chunk
    sample: bool  # whether this chunk ends at the request's last known token, so a next token is sampled
    temperature: float = 0.0
    seed: int = 0


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class Transformer:
    def __init__(self, config: ModelConfig, rank: int = 0, world_size: int = 1, all_reduce=None,
                 device: str | torch.device = "cpu"):
        c = config
        self.device = torch.device(device)
        if c.n_heads % world_size or c.d_ff % world_size:
            raise ValueError(f"n_heads={c.n_heads} and d_ff={c.d_ff} must divide by the world size {world_size}")
        self.config, self.rank, self.world_size = c, rank, world_size
        self.all_reduce = all_reduce if world_size > 1 else None
        self.dtype = getattr(torch, c.dtype)
        self.heads = c.n_heads // world_size
        gen = torch.Generator().manual_seed(c.seed)

        def full(*shape, scale):
            return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale

        def put(t):  # this rank's copy, on the model's device
            return t.contiguous().to(device=self.device, dtype=self.dtype)

        d, hd = c.d_model, c.head_dim
        h0, h1 = rank * self.heads * hd, (rank + 1) * self.heads * hd
        f0, f1 = rank * c.d_ff // world_size, (rank + 1) * c.d_ff // world_size
        self.embed = put(full(c.vocab_size, d, scale=1.0))
        self.pos = put(full(c.max_seq_len, d, scale=0.1))
        self.layers = []
        for _ in range(c.n_layers):
            wqkv = full(3, d, d, scale=2 / math.sqrt(d))
            wo = full(d, d, scale=1 / math.sqrt(d))
            w1 = full(d, c.d_ff, scale=1 / math.sqrt(d))
            w2 = full(c.d_ff, d, scale=1 / math.sqrt(c.d_ff))
            self.layers.append({
                "wqkv": put(wqkv[:, :, h0:h1]),  # this rank's heads
                "wo": put(wo[h0:h1]),
                "w1": put(w1[:, f0:f1]),  # this rank's MLP columns
                "w2": put(w2[f0:f1]),
                "n1": torch.ones(d, dtype=self.dtype, device=self.device),
                "n2": torch.ones(d, dtype=self.dtype, device=self.device),
            })
        self.norm = torch.ones(d, dtype=self.dtype, device=self.device)
        self.lm_head = put(full(d, c.vocab_size, scale=2 / math.sqrt(d)))
        self.cache: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def free(self, request_id: str) -> None:
        self.cache.pop(request_id, None)

    def _kv(self, seg: Segment):
        kv = self.cache.get(seg.request_id)
        if kv is None:
            if seg.start != 0:
                raise RuntimeError(f"request {seg.request_id}: no KV cache for a chunk at position {seg.start}")
            shape = (seg.capacity, self.heads, self.config.head_dim)
            kv = ([torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers],
                  [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers])
            self.cache[seg.request_id] = kv
        return kv

    @torch.inference_mode()
    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """Logits (n_sampling_segments, vocab) of the last token of each segment with sample=True, in order."""
        c = self.config
        for s in segments:
            if s.start + len(s.token_ids) > min(s.capacity, c.max_seq_len):
                raise ValueError(f"request {s.request_id}: position {s.start + len(s.token_ids)} is past its "
                                 f"capacity {s.capacity} or the model's max_seq_len {c.max_seq_len}")
        dev = self.device
        tokens = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long, device=dev)
        positions = torch.tensor([p for s in segments for p in range(s.start, s.start + len(s.token_ids))],
                                 dtype=torch.long, device=dev)
        ends, off = [], 0
        for s in segments:
            off += len(s.token_ids)
            if s.sample:
                ends.append(off - 1)
        # Host -> device copies first: a copy from pageable memory synchronises the stream, which is idle now
        # but would be busy with this step's kernels later (the launch would then wait for the step).
        last_rows = torch.tensor(ends, dtype=torch.long, device=dev)
        x = self.embed[tokens] + self.pos[positions]
        caches = [self._kv(s) for s in segments]
        n, hd = len(tokens), c.head_dim
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x, layer["n1"])
            qkv = torch.einsum("nd,tde->tne", h, layer["wqkv"]).view(3, n, self.heads, hd)
            outs = []
            off = 0
            for s, (kc, vc) in zip(segments, caches):
                m = len(s.token_ids)
                q, k, v = qkv[0, off:off + m], qkv[1, off:off + m], qkv[2, off:off + m]
                kc[li][s.start:s.start + m] = k
                vc[li][s.start:s.start + m] = v
                end = s.start + m
                keys, vals = kc[li][:end].transpose(0, 1), vc[li][:end].transpose(0, 1)
                mask = torch.arange(end, device=dev)[None, :] <= torch.arange(s.start, end, device=dev)[:, None]
                o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals, attn_mask=mask)
                outs.append(o.transpose(0, 1).reshape(m, self.heads * hd))
                off += m
            attn = torch.cat(outs) @ layer["wo"]
            if self.all_reduce:
                self.all_reduce(attn)
            x = x + attn
            mlp = F.gelu(_rms_norm(x, layer["n2"]) @ layer["w1"]) @ layer["w2"]
            if self.all_reduce:
                self.all_reduce(mlp)
            x = x + mlp
        last = _rms_norm(x[last_rows], self.norm)
        return (last @ self.lm_head).float()


GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (argmax): dividing logits by a tinier one overflows to inf and the draw
would be undefined; at such a temperature the draw is the argmax anyway."""


class SampleError(str):
    """What `sample` returns in place of a token when one request's draw fails (its message): only that
    request fails (picklable, so it crosses the worker queue like a token)."""


def _draw(row: torch.Tensor, s: Segment) -> int:
    gen = torch.Generator().manual_seed((s.seed * 1_000_003 + s.start + len(s.token_ids)) % (1 << 63))
    probs = torch.softmax(row / s.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def sample(logits: torch.Tensor | None, segments: list[Segment], argmax=None) -> list[int | SampleError]:
    """One token per sampling segment: argmax below GREEDY_TEMPERATURE, else a draw seeded by (seed, position).
    Never raises for one request's parameters: a segment whose temperature is not a finite number >= 0, or whose
    draw fails, gets a SampleError naming its request instead of a token.

    ``argmax``: each sampling row's argmax, already computed (on the device that ran the step, copied to the
    host); greedy rows take it, so host ``logits`` are needed only for rows that draw (None when none does)."""
    out: list[int | SampleError] = []
    sampling = [s for s in segments if s.sample]
    for i, s in enumerate(sampling):
        t = s.temperature
        try:
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                out.append(SampleError(f"request {s.request_id!r}: temperature must be a finite number >= 0, "
                                       f"got {t!r}"))
            elif t < GREEDY_TEMPERATURE:
                out.append(int(argmax[i]) if argmax is not None else int(torch.argmax(logits[i])))
            else:
                out.append(_draw(logits[i], s))
        except Exception as e:  # this request's draw only; the step and the other requests go on
            out.append(SampleError(f"request {s.request_id!r}: sampling failed at temperature {t!r}: {e}"))
    return out


__all__ = ["GREEDY_TEMPERATURE", "ModelConfig", "PRESETS", "SampleError", "Segment", "Transformer", "model_config",
           "replace", "sample"]
