"""Torch-free utilities both wings use, the library and the node daemon.

The guard that contains failures, rate-limited logging, safe file access on a shared node,
the run directory's records, exit signals, background threads, process-wide wrappers and
the staleness check of generated files.
"""
