"""Switch: an update's tensors held to COMMIT, hashed there when they came without a digest."""

from __future__ import annotations

import blake3

from tests.devices import FakeDeviceTensor, needs_torch
from weightlift.digest.setdigest import set_digest
from weightlift.remote.server.store import Store
from weightlift.remote.server.updates.switch import Switch


@needs_torch
def test_a_device_tensor_held_without_a_digest_is_hashed_through_a_host_copy():
    """A CUDA server holds device tensors; one pushed without a digest is hashed at COMMIT, and
    ``.numpy()`` refuses a device tensor: the commit must still switch, with the right digest."""
    import torch

    host = torch.arange(4096, dtype=torch.int32)
    dev = FakeDeviceTensor(host)
    store = Store(max_memory=1 << 20, pool=None, remember_digests=False)
    switch = Switch(store, in_place=False)
    switch.hold("w", "I32", (4096,), host.nbytes, dev, store.charge(host.nbytes), None)
    reply = switch.commit()
    assert reply.ok, reply.message
    assert dev.copies == ["cpu"]
    assert reply.root == set_digest({"w": blake3.blake3(host.numpy().tobytes()).digest()})
    assert store.entries(["w"])["w"].digest == blake3.blake3(host.numpy().tobytes()).digest()
