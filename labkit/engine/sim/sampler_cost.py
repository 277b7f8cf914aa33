"""The sampler: what turning a step's logits into tokens costs a GPU.

After the LM head, every row a step samples (a decoding request's token, a prompt's
last chunk -- vLLM computes the logits of every scheduled request) goes through vLLM's
sampler, outside the CUDA graph, over the **whole vocabulary** (the LM head's TP shards
are gathered first). What it does depends on the requests' sampling parameters, which
a server takes from the model's `generation_config.json` when the client sends none
(most chat models ship `temperature` and `top_p` there):

- **greedy** (temperature 0): the logits cast to fp32, an argmax;
- **random** (a temperature, no top-k / top-p): the cast, the division by the
  temperature, a softmax, and the draw (an exponential per entry, a division, an argmax);
- **top_p** (top-k and/or top-p filtering, PyTorch's path in vLLM 0.15): the row is
  sorted -- a radix sort of (fp32 value, int64 index) pairs, four 8-bit passes reading
  and writing both -- then a softmax of the sorted values, a cumulative sum, the mask of
  the tail past p, the tail filled with -inf and the row scattered back to vocabulary
  order, before the random draw.

Each of those is a pass over ``rows x vocab`` entries in HBM, so the sampler costs
``rows * vocab_size * bytes / (HBM bandwidth * SAMPLER_HBM_EFFICIENCY)``, the bytes per
entry summed below from the passes. It carries to any GPU through its bandwidth, and it
is what separates two models of equal size with 32K and 152K vocabularies: left out, the
held-out measured runs of ../shared/data/e2e with 128K-152K vocabularies (Llama-3.1,
Qwen3, Qwen2.5) came out 6-20 % faster than measured while the 32K-vocabulary runs the
overheads were fitted on did not (NOTES.md, session 36).
"""

from __future__ import annotations

from labkit.errors import ConfigError
from labkit.specs.config import SAMPLINGS

SAMPLER_HBM_EFFICIENCY = 0.75  # small elementwise kernels and a segmented sort

# bytes read + written per vocabulary entry of one sampled row, pass by pass
_CAST = 2 + 4  # bf16 logits in, fp32 out
_ARGMAX = 4
_TEMPERATURE = 4 + 4
_SOFTMAX = 4 + 4 + 4  # max and sum in one read, normalised in a second read + write
_DRAW = 4 + (4 + 4 + 4) + 4  # exponentials written, divided into the probabilities, argmax
_SORT = 4 * 2 * (4 + 8) + 8  # four radix passes over (value, index) pairs; indices made
_TOP_P = _SOFTMAX + (4 + 4) + (4 + 1) + (4 + 1 + 4) + (4 + 8 + 4)  # softmax, cumsum, mask,
# fill, scatter back

SAMPLER_BYTES = {
    "greedy": _CAST + _ARGMAX,
    "random": _CAST + _TEMPERATURE + _SOFTMAX + _DRAW,
    "top_p": _CAST + _TEMPERATURE + _SORT + _TOP_P + _SOFTMAX + _DRAW,
}


class SamplerCost:
    def __init__(self, vocab_size: int, hbm_bandwidth: float, sampling: str) -> None:
        if sampling not in SAMPLINGS:
            raise ConfigError(f"sampling={sampling!r} is not allowed; allowed: "
                              f"{', '.join(SAMPLINGS)}")
        self.seconds_per_row = vocab_size * SAMPLER_BYTES[sampling] / (
            hbm_bandwidth * SAMPLER_HBM_EFFICIENCY)

    def __call__(self, rows):
        """Seconds for a GPU to sample `rows` rows (a number or an array of them)."""
        return rows * self.seconds_per_row
