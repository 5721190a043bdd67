"""``fusepass bench``: the per-op benchmarks (:mod:`.ops`, over the registry in a
checkout's ``benchmarks/``) and whole models end to end (:mod:`.e2e`).

Everything here is the command's implementation, not API: run it as
``fusepass bench ...`` (``--help`` lists the options).
"""
