"""The ground floor: the exception hierarchy, host buffers and a producer thread.

Imports nothing of the project and not JAX: every other layer builds on it.
"""
