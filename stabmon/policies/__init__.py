"""Acting on anomalies: ``on_anomaly`` policies, agreed across ranks (docs/policies.md).

The detectors say what went wrong, a step late; a policy makes every rank do the same
thing about it: hold the step back (``skip``), cut the LR for a while (``lr_scale``), call
the loop's save once before the damage (``checkpoint``), or raise
:class:`stabmon.AnomalyStop` (``stop``). One module per concern:

- :mod:`~stabmon.policies.actions`: the plan read from the config (which kind does what,
  which are checked before the step, whether the host must read the flags every step);
- :mod:`~stabmon.policies.agreement`: the flags agreed across ranks (one all-reduce MAX)
  and read back on the host;
- :mod:`~stabmon.policies.gate`: what is done to the optimizer's step (a device flag for
  fused optimizers, gradients held back for the others, the LR scaled and restored);
- :mod:`~stabmon.policies.verdict`: ``rank-N.verdict.json`` and the last good checkpoint;
- :mod:`~stabmon.policies.plugin`: the plug-in that ties them to the extension ports.
"""
