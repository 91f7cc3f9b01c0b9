"""Reading checkpoint files: mappings, ``preadv``, the page-cache residency probe, warmers, prefetch,
eviction (:mod:`.source`) and the per-device reader counts (:mod:`.storage`). No knowledge of
formats, targets or the wire."""
