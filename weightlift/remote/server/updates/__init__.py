"""Updates: switching a set of tensors in at once (:mod:`.switch`), the DELTA frames that patch
tensors in place (:mod:`.delta`), and the gates that let an in-place commit wait for READs
(:mod:`.gates`)."""
