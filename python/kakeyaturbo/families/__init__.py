"""What each decoder family transformers ships needs from the cache, found on the loaded model
(needs torch and transformers: the ``eval`` extra).

- `layout`: :func:`describe`, a model per layer (full, sliding-window or chunked attention; a
  hybrid's recurrent or convolution state; KV sharing; multi-head latent attention; heads, the
  RoPE of its keys) and :class:`~kakeyaturbo.errors.UnsupportedModelError` for what cannot work;
- `counts`: what the model's attention modules hold (their layers, head counts and widths), which
  :func:`describe` checks the config against before reading it;
- `rope`: RoPE as the families apply it (pairings, partial rotary, per-layer-type rotary
  modules), its exact inverse and transpose;
- `detect`: which pairing, table form and direction reproduce a family's rotation bit for bit;
- `keynorm`: keys normalised after RoPE with a learnt weight (HunYuan), whose weight comes off
  before RoPE does;
- `capture`: :class:`AttentionCapture`, every layer's queries, keys and values as the model
  hands them to attention (after q/k norms and RoPE), through transformers' AttentionInterface.

It sits above `calibration` and `cache` in the one-way flow: both need it (the statistics are
taken before RoPE, the cache removes and re-applies RoPE and rolls sliding windows).
"""

from .._extras import require

require("kakeyaturbo.families")

from ..errors import UnsupportedModelError  # noqa: E402
from .capture import AttentionCapture  # noqa: E402
from .layout import LayerSpec, ModelLayout, attention_modules, describe, output_projection, rope_for
from .rope import LayerRope, ModelRope, apply_rope, rope_transpose, rotate_half, unapply_rope


__all__ = [
    "AttentionCapture",
    "LayerRope",
    "LayerSpec",
    "ModelLayout",
    "ModelRope",
    "UnsupportedModelError",
    "apply_rope",
    "attention_modules",
    "describe",
    "output_projection",
    "rope_for",
    "rope_transpose",
    "rotate_half",
    "unapply_rope",
]
