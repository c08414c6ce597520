"""Named engine calibrations for ``burstgate simulate --engine-profile``.

Each profile is data for the one engine model (``engine.py``): the figures
and, beside each, where it comes from. docs/simulate.md derives them at
more length and lists what the model leaves out.

- ``h100-8b`` (the default): Llama-3.1-8B, bf16, one H100 SXM 80 GB, vLLM
  with chunked prefill. The prefill cost is fitted so the model reproduces
  vLLM's own published throughput on a prefill-heavy benchmark (below);
  the rest is first principles, cross-checked against a published ShareGPT
  run.
- ``h100-8b-peak``: the calibration burstgate's figures were first measured
  with (22 us per token, prefill and decode alike: ~73 % of the H100's peak
  bf16 FLOPs). Optimistic: it drains a backlog ~1.6x faster than vLLM does
  on the benchmark below. Kept so the old figures can be reproduced.
- ``h100x4-70b``: Llama-3.1-70B, bf16, four H100 SXM with tensor parallel
  4, vLLM with chunked prefill. Derived from ``h100-8b`` by the FLOPs and
  bytes per GPU; no public prefill figure for exactly this setup was found,
  so it is checked against a published 70B-on-4-GPUs / 8B-on-1-GPU
  throughput ratio instead (docs/simulate.md).

The public figures (cited by name below):

- [vllm-4600] vLLM PR #4600 "bump version to v0.4.2"
  (https://github.com/vllm-project/vllm/pull/4600): on one H100,
  ``benchmark_throughput.py --input-len 1000 --output-len 100 --model
  meta-llama/Meta-Llama-3-8B-Instruct`` gives 20.72 requests/s (v0.4.1):
  20.7k prompt + 2.1k output tokens/s. The model, offered the same 1,000
  requests at once, gives 20.6 requests/s with this profile (a test holds
  it within 5 %) and 32.4 with ``h100-8b-peak``.
- [vllm-8804] vLLM PR #8804 (https://github.com/vllm-project/vllm/pull/8804):
  Llama-3-8B on one H100, 1,000 ShareGPT prompts at once (215 input / 128
  output tokens on average): 51.3 requests/s, mean TPOT 19.8 ms. The model
  on a ShareGPT-like mix of the same means: 44.5 requests/s (decode not
  flattered).
- [vllm-5046] vLLM PR #5046 "Bump version to v0.4.3"
  (https://github.com/vllm-project/vllm/pull/5046): offline ShareGPT, a
  70B model on 4 GPUs at 10.15 requests/s, an 8B-class model on 1 GPU at
  15.62 (ratio 0.65); the v0.6.0 blog
  (https://blog.vllm.ai/2024/09/05/perf-update.html) then sped up 8B on
  1xH100 by 2.7x and 70B on 4xH100 by 1.8x, which makes the ratio ~0.43.
  The model's ratio on a ShareGPT-like mix: 0.46.
- [h100] NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3,
  80 GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.sim.engine import EngineParams


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str
    summary: str  # one line, for --help and reports
    params: EngineParams


H100_8B = EngineParams(
    max_num_seqs=256,  # vLLM's default --max-num-seqs
    max_num_batched_tokens=8_192,  # a common chunked-prefill budget on an 80 GB GPU
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per
    # token; 0.9 x 80 GB - 16 GB weights - ~4 GB activations and CUDA
    # graphs ~ 52 GB -> ~400k tokens [h100]
    kv_capacity_tokens=400_000,
    block_size=16,  # vLLM's default block size
    # reading 16 GB of weights at 3.35 TB/s ~ 4.8 ms [h100], plus
    # scheduling and sampling: ~6 ms a step
    step_base_us=6_000.0,
    # fitted to [vllm-4600]: 20.72 requests/s at 1,000 in / 100 out
    # (22 us, the peak profile's figure, gives 32.4)
    prefill_token_us=39.0,
    # 2 x 8e9 FLOP per token at ~700 TFLOP/s of the 989 peak [h100]; with
    # the step and KV costs this gives 44.5 requests/s where [vllm-8804]
    # measured 51.3 (decode is not flattered)
    decode_token_us=22.0,
    # causal attention in prefill: 4 x 32 layers x 4,096 (heads x dims)
    # = 0.52 MFLOP per (query, key) pair at ~400 TFLOP/s achieved [h100]
    prefill_attention_us_per_pair=0.0013,
    # 128 KiB of KV read per context token per step at 3.35 TB/s [h100]
    attention_us_per_kv_token=0.039,
)

H100_8B_PEAK = EngineParams(
    max_num_seqs=256,
    max_num_batched_tokens=8_192,
    kv_capacity_tokens=400_000,
    block_size=16,
    step_base_us=6_000.0,
    # 2 x 8e9 FLOP per token at ~700 TFLOP/s (73 % of the 989 peak): the
    # figure that flattered burstgate (45k prefill tokens/s)
    prefill_token_us=22.0,
    decode_token_us=22.0,
    prefill_attention_us_per_pair=0.0,  # the old model had no such term
    attention_us_per_kv_token=0.039,
)

H100X4_70B = EngineParams(
    max_num_seqs=256,  # vLLM's default --max-num-seqs
    max_num_batched_tokens=8_192,  # the same chunked-prefill budget as h100-8b
    # 2 x 80 layers x 8 KV heads x 128 dims x 2 bytes = 320 KiB per token
    # (80 KiB on each GPU); per GPU 0.9 x 80 GB - 35.3 GB of weights (141 GB
    # / 4) - ~4 GB activations ~ 33 GB -> 4 x 33 GB / 320 KiB ~ 400k tokens
    kv_capacity_tokens=400_000,
    block_size=16,
    # 35.3 GB of weights per GPU at 3.35 TB/s ~ 10.5 ms [h100], plus two
    # all-reduces per layer (160 at ~15-20 us) and scheduling: ~14 ms
    step_base_us=14_000.0,
    # h100-8b's 39 us x 2.19 (35.3 vs 16.1 GFLOP per token per GPU) x 1.1
    # (tensor-parallel all-reduce of the activations); checked against
    # [vllm-5046] (docs/simulate.md)
    prefill_token_us=94.0,
    decode_token_us=48.0,  # h100-8b's 22 us x 2.19, as above
    # 4 x 80 layers x 8,192 = 2.6 MFLOP per pair, a quarter per GPU, at
    # ~400 TFLOP/s achieved [h100]
    prefill_attention_us_per_pair=0.00164,
    # 80 KiB of KV per GPU per context token at 3.35 TB/s [h100]
    attention_us_per_kv_token=0.0245,
)

DEFAULT_PROFILE = "h100-8b"
PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        EngineProfile(
            "h100-8b",
            "Llama-3.1-8B bf16, 1x H100, vLLM (fitted to vLLM's published throughput)",
            H100_8B,
        ),
        EngineProfile(
            "h100-8b-peak",
            "the old optimistic calibration: 22 us/token, 73 % of peak FLOPs",
            H100_8B_PEAK,
        ),
        EngineProfile(
            "h100x4-70b",
            "Llama-3.1-70B bf16, 4x H100 tensor parallel, vLLM (derived from h100-8b)",
            H100X4_70B,
        ),
    )
}


def engine_profile(name: str) -> EngineProfile:
    """The profile called ``name``; an unknown name is an error naming the
    option and the known profiles."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"--engine-profile: unknown profile {name!r}; known: {', '.join(PROFILES)}"
        ) from None
