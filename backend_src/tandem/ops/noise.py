"""The purposes of sampled decoding's Philox noise: the second word of its key ``(seed, purpose)``
(:mod:`tandem.engine.sampling`). The numpy sampler and the Triton sampler (:mod:`tandem.ops.triton.sampler`)
draw the same numbers for the same purpose, so they are declared once, here."""

#: noise purposes: a draft token, its acceptance, the residual sample, the bonus token, Gumbel-max noise
DRAFT, ACCEPT, RESIDUAL, BONUS, GUMBEL = 0, 1, 2, 3, 4
