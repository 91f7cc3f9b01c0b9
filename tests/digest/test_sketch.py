"""The linear sketch (weightlift.digest.sketch): its definition, composition, and what it catches."""

from __future__ import annotations

import numpy as np
import pytest

from weightlift.digest.sketch import sketch, sketch_base, sketch_bytes, sketch_part
from weightlift.errors import OptionError

M = 2**64


def _reference(words: np.ndarray, r: int) -> int:
    return sum(int(v) * pow(r, i, M) for i, v in enumerate(words.reshape(-1))) % M


@pytest.mark.parametrize("dtype", ["<u1", "<u2", "<u4", "<u8", "<f4", "<f8"])
def test_definition_over_16_bit_words(dtype):
    """Elements of 4 and 8 bytes are read as 2 and 4 little-endian 16-bit words."""
    rng = np.random.default_rng(0)
    x = np.frombuffer(rng.bytes(6 * 5 * np.dtype(dtype).itemsize), dtype=dtype).reshape(6, 5)
    r = sketch_base("w", b"k")
    words = x.view("<u1") if x.itemsize == 1 else x.reshape(-1).view(np.uint8).view("<u2")
    assert sketch(x, "w", b"k") == _reference(words, r)
    assert sketch_bytes(x.tobytes(), x.itemsize, x.shape, "w", b"k") == sketch(x, "w", b"k")


@pytest.mark.parametrize("dtype", ["<u2", "<f4", "<f8"])
def test_parts_of_any_boxes_compose(dtype):
    rng = np.random.default_rng(1)
    x = np.frombuffer(rng.bytes(7 * 6 * 3 * np.dtype(dtype).itemsize), dtype=dtype).reshape(7, 6, 3)
    r = sketch_base("t")
    boxes = [((0, 3), (0, 6), (0, 3)), ((3, 7), (0, 2), (0, 3)), ((3, 7), (2, 6), (0, 1)), ((3, 7), (2, 6), (1, 3))]
    parts = sum(sketch_part(x[tuple(slice(a, b) for a, b in box)], x.shape, box, r, rows_per_block=2) for box in boxes)
    assert parts % M == sketch(x, "t")


def test_a_scalar_and_an_empty_tensor():
    assert sketch(np.array(7, dtype=np.uint16), "s") == 7
    assert sketch(np.array(1.0, dtype=np.float32), "s") == _reference(
        np.array([1.0], "<f4").view("<u2"), sketch_base("s")
    )
    assert sketch(np.zeros((0, 4), np.float32), "e") == 0


def test_top_bits_of_two_64_bit_elements_are_caught():
    """Read as whole 64-bit elements, a sign flip in any two float64 values would cancel
    (2**63 * (r**i + r**j) is 0 mod 2**64: r**i + r**j is even); as 16-bit words it cannot."""
    x = np.random.default_rng(2).standard_normal(64)
    y = x.copy()
    y[3], y[40] = -y[3], -y[40]
    for seed in (b"", b"a", b"b"):
        assert sketch(y, "d", seed) != sketch(x, "d", seed)
    r = sketch_base("d")
    as64 = (1 << 63) * (pow(r, 3, M) + pow(r, 40, M)) % M  # what the 64-bit reading would have missed
    assert as64 == 0


def test_every_single_word_change_is_caught():
    x = np.random.default_rng(3).integers(0, 1 << 16, 50, dtype=np.uint16)
    base = sketch(x, "w")
    for i in range(x.size):
        for bit in (0, 7, 15):
            y = x.copy()
            y[i] ^= np.uint16(1 << bit)
            assert sketch(y, "w") != base


def test_bad_input_is_an_option_error():
    with pytest.raises(OptionError, match="do not fill the box"):
        sketch_part(np.zeros(5, np.uint16), (10,), ((0, 4),), 3)
    with pytest.raises(OptionError, match="16 bytes"):
        sketch(np.zeros(2, np.complex128), "c")
    with pytest.raises(OptionError, match="3 bytes"):
        sketch_bytes(b"\0" * 6, 3, (2,), "x")
