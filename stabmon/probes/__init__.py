"""Measurement only: probes read the model, the optimizer and the machine; they judge nothing."""
