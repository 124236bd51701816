"""A tiny random-weight diffusers Wan model and rollout inputs, for CPU tests (fp32).

2 layers, 2 heads of 32, 4 latent channels; latent frames of 8 x 12 with Wan's 1x2x2 patch are
24 tokens per frame, so blocks of 16 or 7 tokens never line up with frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import WanTransformer3DModel

TOKENS_PER_FRAME = 24
HEIGHT, WIDTH = 8, 12
CHANNELS = 4
TEXT_DIM = 16
# fp32 model, fp32 paged attention (Triton interpreter) against a float64 dense reference.
ATOL = RTOL = 5e-5


def tiny_wan(seed: int = 0, **overrides) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=64,
    )
    config.update(overrides)
    return WanTransformer3DModel(**config).eval()


@dataclass
class Inputs:
    noise: torch.Tensor
    prompt: torch.Tensor
    negative: torch.Tensor
    actions: torch.Tensor


def rollout_inputs(frames: int, *, blocks: int, action_tokens: int = 3, seed: int = 1) -> Inputs:
    """Noise for ``blocks`` blocks of ``frames`` latent frames, two prompts, action states."""
    g = torch.Generator().manual_seed(seed)
    return Inputs(
        noise=torch.randn(1, CHANNELS, frames * blocks, HEIGHT, WIDTH, generator=g),
        prompt=torch.randn(1, 5, TEXT_DIM, generator=g),
        negative=torch.randn(1, 5, TEXT_DIM, generator=g),
        actions=torch.randn(blocks, action_tokens, 64, generator=g),
    )


def poison(cache) -> None:
    """NaN in every pool slot (a read of an unwritten slot shows as NaN); quantized pools: in
    the scales (int8 codes cannot be NaN) and, for k8v8's e4m3 V, the codes too."""
    for pool in (cache.k_pools, cache.v_pools, cache.k_scales, cache.v_scales):
        if pool.dtype != torch.int8:
            pool.fill_(float("nan"))


def assert_close_to_quantized_oracle(
    got: torch.Tensor, oracle: torch.Tensor, unquantized: torch.Tensor, msg: str = ""
) -> None:
    """Latents of a rollout over quantized pools against the reference reading the same
    quantized K/V (``oracle``), measured against what quantizing does (``unquantized``: the
    reference without quantization).

    Not ``assert_close`` at ``ATOL``: a key or value whose ``x / scale`` lies within float32
    rounding of a rounding boundary gets the neighbouring code in one rollout and not the other
    (their K/V differ by float32 rounding from the first block's attention on), and one code
    step (e4m3: 1/16 to 1/8 of the value; int8: 1/127 of the row's largest) moves some latents
    by up to ~5e-4. The reference does the same to itself with float32 instead of float64
    attention. So the check is relative to the quantization's own effect on the latents: the
    mean difference from the oracle at most 10% of the oracle's mean difference from the
    unquantized rollout (measured: 0.1% to 2.1%; the same pools quantized another way, e.g. no
    K smoothing, give ~90%), and the largest difference below the quantization's largest.
    """
    assert not torch.isnan(got).any(), f"{msg}: NaN latents"
    diff = (got - oracle).abs()
    effect = (oracle - unquantized).abs()
    assert effect.max().item() > 2 * ATOL, f"{msg}: quantizing changed nothing"
    ratio = diff.mean().item() / effect.mean().item()
    assert ratio <= 0.1, f"{msg}: mean difference {ratio:.1%} of the quantization's"
    assert diff.max().item() < effect.max().item(), f"{msg}: largest difference {diff.max()}"


def assert_within_flipped_codes(
    got: torch.Tensor, single: torch.Tensor, unquantized, share: float = 0.5
) -> None:
    """Latents of a parallel rollout over quantized pools against the single process's: the
    mean difference at most ``share`` (half) of the quantization's mean effect (``single -
    unquantized``), the largest below its largest.

    Not ``ATOL``, nor ``assert_close_to_quantized_oracle``'s 10%: from the third block on, codes
    flip where float32 rounding moves K (the ranks project token shards or one branch, and
    merge partials), and the int8 rollouts of tests/models/sharded_worker.py are chaotic in
    that: one process moves 6% (its noise moved by 1e-7 relative) to 26% (1e-6) from itself.
    Measured there: 5.7% (window shards), 24% (CFG x shards); ranks that chose
    from their own tokens or branch, 1200% and 124%.
    """
    assert not torch.isnan(got).any()
    diff, effect = (got - single).abs(), (single - unquantized).abs()
    assert effect.max().item() > 2 * ATOL, "quantizing changed nothing"
    ratio = diff.mean().item() / effect.mean().item()
    assert ratio <= share, f"mean difference {ratio:.1%} of the quantization's"
    assert diff.max().item() < effect.max().item(), f"largest difference {diff.max()}"
