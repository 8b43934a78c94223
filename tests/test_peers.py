"""The same op in other layers as a call's control: which calls are peers, and the largest jump
among a call's peers, never its own."""

from __future__ import annotations

import numpy as np

from dumpdiff.analyzer.index.columns import Columns
from dumpdiff.analyzer.verdict.noise import suspects
from dumpdiff.analyzer.verdict.peers import MIN_PEER_JUMP, PEER_FACTOR, op_classes, peer_line, peer_maxima


def test_peers_differ_only_in_numeric_path_parts_and_module_class():
    names = np.array(
        [
            "model.layers.0.mlp#0",
            "model.layers.12.mlp#0",
            "model.layers.3.mlp.experts.7.down_proj#0",
            "model.layers.4.mlp.experts.0.down_proj#0",
            "lm_head#0",
            "<root>#0",
            "model.layers.1.mlp#0",
            "model.layers.2.mlp#1",
        ],
        dtype=object,
    )
    kinds = ["LlamaMLP", "LlamaMLP", "Linear", "Linear", "Linear", "Llama", "MoeBlock", "LlamaMLP"]
    classes = op_classes(names, kinds)
    assert classes[0] == classes[1] and classes[2] == classes[3]
    assert classes[6] != classes[0]  # a dense first layer's MLP is no peer of an MoE block
    assert classes[7] != classes[0]  # a second call of the module is another op
    assert len({classes[4], classes[5], classes[0], classes[2]}) == 4  # no numeric part: alone


def test_a_call_is_judged_against_the_largest_of_its_peers_never_itself():
    classes = np.array([0, 0, 0, 1])  # call codes 0-2 are peers; 3 is alone
    ccode = np.array([0, 0, 1, 2, 2, 3])
    jump = np.array([2.0, 40.0, 3.0, 1.5, np.nan, 7.0])
    eligible = np.isfinite(jump)
    best, count = peer_maxima(jump, ccode, eligible, classes)
    assert best[0] == 3.0 and best[1] == 40.0 and best[2] == 40.0  # the largest call's peers: the next one
    assert count.tolist()[:3] == [2, 2, 2] and np.isnan(best[3]) and count[3] == 0
    assert peer_line(best[:1])[0] == max(PEER_FACTOR * 3.0, MIN_PEER_JUMP)
    _, count = peer_maxima(jump, ccode, eligible & (ccode != 2), classes)
    assert count.tolist()[:3] == [1, 1, 2]  # a call with no eligible cell is no peer


def test_a_suspect_needs_an_error_a_kernel_cannot_make_from_inputs_an_ulp_off():
    """Float32 on a GPU: layer 0's attention, fed inputs an ulp off, makes a few epsilons of its
    own and stands 4-12x above the same op in later layers (which barely amplify the noise they
    carry). That is no suspect. The same jump with an error past 1/8 of the least error a call
    can introduce (100 float32 epsilons: 12.5) is, and so is a bfloat16 jump of a few epsilons."""
    f32, bf16 = 2.0**-23, 2.0**-7
    eps = np.array([f32, f32, bf16])
    out_eps = np.array([6.0, 20.0, 4.0])  # each cell's output error in epsilons of its type
    amp, peers = np.array([6.0, 6.0, 6.0]), np.array([1.0, 1.0, 1.0])
    calls = Columns(
        {
            "amplification": amp,
            "gap_amplification": np.zeros(3),
            "out_err": out_eps * eps,
            "arrived": out_eps * eps / amp,
            "eps": eps,
        }
    )
    names = np.array(["model.layers.0.self_attn#0", "model.layers.2.self_attn#0", "model.layers.3.mlp#0"], dtype=object)
    lines = np.full(3, 8.0)  # under the line: suspects by their distance above their peers alone
    none = np.zeros(3, dtype=bool)
    found = suspects(calls, names, lines, lines, peers, np.full(3, np.nan), none, none)
    assert [s["call"] for s in found] == ["model.layers.2.self_attn#0", "model.layers.3.mlp#0"], found
