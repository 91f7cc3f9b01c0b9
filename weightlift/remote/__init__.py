"""Remote weights: the sans-I/O wire protocol (:mod:`.protocol`), the byte streams it runs over
(:mod:`.transport`), content digests and the client's digest sidecar (:mod:`.digest`), the client
(:mod:`.client`) and the tensor server (:mod:`.server`)."""
