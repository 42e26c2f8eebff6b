"""The ground floor: the exception hierarchy, host buffers, a producer thread and the progress bars.

Imports nothing of the project and not JAX: every other layer builds on it.
"""
