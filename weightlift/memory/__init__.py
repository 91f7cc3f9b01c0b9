"""Where tensors land: fresh host memory and its fill policy (:mod:`.fresh`), the size-class pool
of reused host memory (:mod:`.pool`), the helper threads that fault fresh memory in ahead of a
receiver (:mod:`.faulter`), and the targets that turn bytes into numpy, torch or CUDA tensors
(:mod:`.targets`). Used by the local loader and by the tensor server alike."""
