"""The checks a weight update passes before it reaches a vLLM model (no vLLM needed; the engine
itself against a real vLLM: test_vllm.py)."""

from __future__ import annotations

import numpy as np
import pytest

from weightlift import OptionError
from weightlift.integrations.vllm.updates import checked, checkpoint_shapes, layer_key, whole_layers

EXPECTED = {
    "model.embed_tokens.weight": (8, 4),
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.self_attn.k_proj.weight": (2, 4),
    "model.layers.0.self_attn.rotary_emb.inv_freq": (2,),
    "model.layers.0.input_layernorm.weight": (4,),
    "model.layers.1.self_attn.q_proj.weight": (4, 4),
    "model.layers.10.self_attn.q_proj.weight": (4, 4),
    "model.layers.1.block_sparse_moe.experts.0.w1.weight": (4, 4),
    "model.layers.1.block_sparse_moe.experts.1.w1.weight": (4, 4),
    "model.norm.weight": (4,),
}


def _held(names):
    return {n: np.zeros(EXPECTED[n], np.float32) for n in names}


def test_a_layer_is_the_name_up_to_its_first_number():
    assert layer_key("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_key("model.layers.1.block_sparse_moe.experts.7.w1.weight") == "model.layers.1"
    assert layer_key("model.language_model.layers.0.mlp.up_proj.weight") == "model.language_model.layers.0"
    assert layer_key("model.norm.weight") == "model.norm.weight"


def test_a_name_brings_the_rest_of_its_layer_in_name_order():
    held = _held(n for n in EXPECTED if "inv_freq" not in n)  # vLLM skips the rotary table
    got = whole_layers(["model.layers.0.self_attn.q_proj.weight"], held, EXPECTED)
    assert got == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    got = whole_layers(["model.layers.1.block_sparse_moe.experts.0.w1.weight"], held, EXPECTED)
    assert got == [  # every expert of the layer, and not layer 10
        "model.layers.1.block_sparse_moe.experts.0.w1.weight",
        "model.layers.1.block_sparse_moe.experts.1.w1.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert whole_layers(["model.norm.weight"], held, EXPECTED) == ["model.norm.weight"]


def test_part_of_a_layer_on_the_server_is_refused_naming_what_it_lacks():
    held = _held(["model.layers.1.block_sparse_moe.experts.0.w1.weight", "model.layers.1.self_attn.q_proj.weight"])
    with pytest.raises(OptionError, match=r"reloaded whole.*experts\.1\.w1"):
        checked(held, sorted(held), EXPECTED)


def test_an_update_is_checked_against_the_checkpoint():
    with pytest.raises(OptionError, match="holds no tensors"):
        checked({}, [], EXPECTED)
    with pytest.raises(OptionError, match="not on the server: model.norm.weight"):
        checked({}, ["model.norm.weight"], EXPECTED)
    with pytest.raises(OptionError, match=r"names must be strings, not \['int'\]"):
        checked({"model.norm.weight": np.zeros(4, np.float32)}, [3], EXPECTED)
    with pytest.raises(OptionError, match="not in the model's checkpoint: extra"):
        checked({"extra": np.zeros(1)}, ["extra"], EXPECTED)
    wrong = {"model.norm.weight": np.zeros(5, np.float32)}
    with pytest.raises(OptionError, match=r"shapes differ: model.norm.weight \(5,\) \(the model's is \(4,\)\)"):
        checked(wrong, ["model.norm.weight"], EXPECTED)
    held = _held(["model.norm.weight"])
    assert checked(held, ["model.norm.weight"], EXPECTED) == [("model.norm.weight", held["model.norm.weight"])]
    assert [n for n, _ in checked({"anything": 1}, ["anything"], None)] == ["anything"]  # no checkpoint to check


def test_error_messages_list_a_few_names_and_count_the_rest():
    held = {f"t{i:02d}": np.zeros(1) for i in range(11)}
    with pytest.raises(OptionError, match=r"t07 \(and 3 more\)$"):
        checked(held, sorted(held), EXPECTED)


def test_checkpoint_shapes_reads_the_headers_or_gives_up(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.uint8)}, str(tmp_path / "model.safetensors"))
    assert checkpoint_shapes(str(tmp_path)) == {"a": (2, 3), "b": (4,)}
    assert checkpoint_shapes("org/hub-name") is None  # not a folder: vLLM's loaders check alone
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    assert checkpoint_shapes(str(tmp_path)) is None


def test_the_rest_of_a_layer_is_held_to_the_checkpoints_shapes_too():
    held = _held(n for n in EXPECTED if "inv_freq" not in n)
    held["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 4), np.float32)  # not the model's (2, 4)
    with pytest.raises(OptionError, match=r"shapes differ: model.layers.0.self_attn.k_proj.weight \(3, 4\)"):
        checked(held, ["model.layers.0.self_attn.q_proj.weight"], EXPECTED)


def test_without_the_checkpoint_a_name_still_brings_what_the_server_holds_of_its_layer():
    held = _held(
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]
    )
    got = [n for n, _ in checked(held, ["model.layers.0.self_attn.q_proj.weight"], None)]
    assert got == ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
