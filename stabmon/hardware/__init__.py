"""Torch-free GPU enumeration and NVML, shared by the node daemon and the library's probes.

``nvml`` is the only module that imports pynvml; ``devices`` resolves which physical GPUs
``CUDA_VISIBLE_DEVICES`` names.
"""
