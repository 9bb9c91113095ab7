"""The pipe from the device to a verdict, and on to what is published.

Deferred readback (never a sync), the judging engine (when results are judged, by which
thread), the measurements and the judge each result carries, the recorder (counting,
records, step numbers), the step sampler, the readings the exporter publishes, and
throughput.
"""
