"""The node daemon: GPU, process and liveness telemetry for every training process on a node."""
