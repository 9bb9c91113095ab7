"""What ``attach`` builds, and how it hooks into torch, the run directory and the process.

The assembly of one Monitor's parts, the bodies of its torch hooks, the plug-ins and the
Context they are handed, the run-directory registration, the resources ``detach()``
closes, and the stall responder. Nothing here holds math or judgement.
"""
