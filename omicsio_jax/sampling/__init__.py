"""Which cells are served when: sampling plans, the per-step schedule, the coverage audit, label entropy.

Pure functions of ``(seed, epoch, step)``; imports only `omicsio_jax.core`.
"""
