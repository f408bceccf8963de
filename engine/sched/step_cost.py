"""What an engine step costs on this machine, learned from the steps the engine runs.

A step's time is about ``fixed + per_decode * D + per_prompt * P`` for D decoding rows and P
prompt tokens: the fixed part reads the weights once and runs the step's host code, a decode
row adds its share of every product, its LM head row and its sampling, a prompt token its
share of the products. How these compare is a property of the machine (memory bandwidth
against arithmetic), the model and the kernels: on a 2-core AMD EPYC Zen 3 with float32
products a prompt token costs ~1.8 ms and the fixed part ~10-20 ms, so 12 prompt tokens
joining 4 decoding streams make a step 2x a decode-only one; on a Zen 4 with bf16 products,
which take 16 rows at a time, the same step costs 1.5x. The scheduler asks this model how many
prompt tokens a decoding step can carry and stay within a given multiple of its decode-only
cost (``prompt_tokens_within``), instead of one constant for every CPU.

The fit is least squares over the recent steps (each weighted by ``1 - 1 / WINDOW_STEPS`` per
step since), solved anew when asked: three running sums per coefficient pair, no history.
"""

from __future__ import annotations

import math

# The fit forgets a step's weight by 1/e over about this many steps: long enough to span the
# shapes a serving load mixes (decode-only steps, steps with a prompt chunk, whole prefills),
# short enough to follow a change of load on the machine.
WINDOW_STEPS = 256
# Steps seen before the fit is used (the caller keeps its own rule until then), after the first
# few, left out (a fresh process's first steps run cold: caches, allocations, lazy set-up).
MIN_STEPS = 32
SKIPPED_STEPS = 4
# A prompt token runs every product of the model but the LM head; a decode row runs them all
# and samples. So a prompt token costs no less than this share of a decode row: a fit that
# says less (steps of alike shapes, noise) is held to it, so that a bad fit cannot let a long
# prefill into a decoding step.
MIN_PROMPT_SHARE = 0.25


class StepCost:
    """A decayed least-squares fit of step seconds to (1, decoding rows, prompt tokens)."""

    def __init__(self) -> None:
        self._keep = 1.0 - 1.0 / WINDOW_STEPS
        # Sums of x_i x_j and x_i y for x = (1, D, P), y the step's seconds, decayed per step.
        self._xx = [0.0] * 6  # 11, 1D, 1P, DD, DP, PP
        self._xy = [0.0] * 3
        self.num_steps = 0  # (fitted; after the SKIPPED_STEPS first)
        self._seen = 0

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """Record one finished step: its decoding rows, its other tokens, its time."""
        self._seen += 1
        if self._seen <= SKIPPED_STEPS or not math.isfinite(seconds):
            return
        k, d, p = self._keep, float(decodes), float(prompt_tokens)
        xx, xy = self._xx, self._xy
        for i, v in enumerate((1.0, d, p, d * d, d * p, p * p)):
            xx[i] = xx[i] * k + v
        for i, v in enumerate((1.0, d, p)):
            xy[i] = xy[i] * k + v * seconds
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed, per decode row, per prompt token) in seconds, or None until the recent steps
        tell them apart (too few, or all of one shape)."""
        if self.num_steps < MIN_STEPS:
            return None
        s11, s1d, s1p, sdd, sdp, spp = self._xx
        y1, yd, yp = self._xy
        # Cramer's rule on the 3 x 3 normal equations (symmetric).
        det = (s11 * (sdd * spp - sdp * sdp) - s1d * (s1d * spp - sdp * s1p) + s1p * (s1d * sdp - sdd * s1p))
        if min(sdd, spp) <= 1e-9 or det <= 1e-6 * s11 * sdd * spp:
            return None
        fixed = (y1 * (sdd * spp - sdp * sdp) - s1d * (yd * spp - sdp * yp) + s1p * (yd * sdp - sdd * yp)) / det
        per_decode = (s11 * (yd * spp - sdp * yp) - y1 * (s1d * spp - sdp * s1p) + s1p * (s1d * yp - yd * s1p)) / det
        per_prompt = (s11 * (sdd * yp - yd * sdp) - s1d * (s1d * yp - yd * s1p) + y1 * (s1d * sdp - sdd * s1p)) / det
        if per_decode <= 0:
            return None
        return max(fixed, 0.0), per_decode, max(per_prompt, MIN_PROMPT_SHARE * per_decode)

    def prompt_tokens_within(self, decodes: int, ratio: float) -> float | None:
        """The prompt tokens a step decoding ``decodes`` rows may carry and cost at most ``ratio``
        times a decode-only step (None while the fit is not known)."""
        fit = self.coefficients()
        if fit is None:
            return None
        fixed, per_decode, per_prompt = fit
        return (ratio - 1.0) * (fixed + per_decode * decodes) / per_prompt
