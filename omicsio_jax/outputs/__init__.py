"""Output kinds: how a minibatch of encoded records becomes the batch's ``x``.

Each kind is one module behind the interface in `omicsio_jax.outputs.base` (`Dense`, `Panel`, `CSR`,
`GeneformerTokens`, `ScGPTTokens`, `Modalities`); beside them the numba kernels they run (scatter,
token kernels), the token vocabularies, the normalization modes and the batch types.
"""
