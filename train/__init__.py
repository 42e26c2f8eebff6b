"""train: Equinox + optax training loops on omicsio_jax datasets (uses only omicsio_jax's public API).

The training application arrives with the loader; see the README's roadmap.
"""
