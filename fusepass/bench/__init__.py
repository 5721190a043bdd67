"""``fusepass bench``: the per-op benchmarks (:mod:`.ops`, over the registry in
:mod:`.registry`), whole models end to end (:mod:`.e2e`) and BENCHMARKS.md
generated from their JSON (:mod:`.page`).

Everything here is the command's implementation, not API: run it as
``fusepass bench ...`` (``--help`` lists the options).
"""
