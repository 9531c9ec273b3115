"""Attribution: groups of tensors, each variant the load it claims to be, the summary, and
``qllama attribute``."""

from __future__ import annotations

import json

import pytest

import qllama
from qllama.cli import main
from qllama.errors import QllamaError
from qllama.measure.attribution import Measure, attribute, groups
from qllama.measure.compare import Reference, reference_from_model

PROMPT = [1, 40, 77, 200, 5]
NEW = 12
CLASSES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


@pytest.fixture(scope="module")
def reference(tiny_variants) -> Reference:
    """The F32 file's greedy continuation and logits (dequantize-all, numpy)."""
    f32 = qllama.load(tiny_variants["F32"], dequantize_all=True)
    return reference_from_model(f32, PROMPT, max_new_tokens=NEW)


def names(n_layer: int, *, tied: bool) -> list[str]:
    out = ["token_embd.weight"]
    for i in range(n_layer):
        out += [f"blk.{i}.{c}.weight" for c in CLASSES]
    return out if tied else [*out, "output.weight"]


def test_groups():
    tied = groups(names(2, tied=True), "class", tied=True, kind="weights")
    assert list(tied) == ["output", *CLASSES]
    assert tied["output"] == ["token_embd.weight"]
    assert tied["ffn_down"] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
    untied = groups(names(2, tied=False), "class", tied=False, kind="weights")
    assert untied["token_embd"] == ["token_embd.weight"] and untied["output"] == ["output.weight"]
    # a lookup has no activations to quantize
    assert "token_embd" not in groups(names(2, tied=False), "class", tied=False, kind="activations")
    layers = groups(names(2, tied=True), "layer", tied=True, kind="weights")
    assert list(layers) == ["output", "blk.0", "blk.1"] and len(layers["blk.1"]) == 7
    each = groups(names(2, tied=True), "tensor", tied=True, kind="weights")
    assert list(each) == names(2, tied=True)
    with pytest.raises(QllamaError, match="attribution by 'head'"):
        groups(names(2, tied=True), "head", tied=True, kind="weights")


def test_weight_attribution_variants_are_what_they_claim(tiny_variants, reference):
    path, f32 = tiny_variants["Q8_0"], tiny_variants["F32"]
    result = attribute(path, reference, kind="weights", f32_path=f32)
    assert [p.group for p in result.parts] == ["output", *CLASSES]
    # the baseline is the F32 file, the whole is the quantized file, both under f32 arithmetic
    assert result.baseline == Measure.of(qllama.load(f32, activations="f32"), reference)
    assert result.whole == Measure.of(qllama.load(path, activations="f32"), reference)
    # a part: that class's weights from the quantized file, the rest F32
    part = next(p for p in result.parts if p.group == "ffn_down")
    alone = qllama.load(f32, activations="f32", weights_from={"blk.*.ffn_down.weight": path})
    assert part.measure == Measure.of(alone, reference)
    assert result.whole.mean_kld > result.baseline.mean_kld


def test_activation_attribution_variants_are_what_they_claim(tiny_variants, reference):
    path = tiny_variants["Q8_0"]
    result = attribute(path, reference, kind="activations", by="layer")
    assert [p.group for p in result.parts] == ["output", "blk.0", "blk.1"]
    assert result.baseline == Measure.of(qllama.load(path, activations="f32"), reference)
    assert result.whole == Measure.of(qllama.load(path), reference)  # the CPU arithmetic
    part = next(p for p in result.parts if p.group == "blk.1")
    alone = qllama.load(path, arithmetic={"blk.1.*": "q8", "*": "f32"})
    assert part.measure == Measure.of(alone, reference)


def test_summary_and_numbers(tiny_variants, reference):
    calls = []
    result = attribute(
        tiny_variants["Q4_K"],
        reference,
        f32_path=tiny_variants["F32"],
        progress=lambda done, total, label: calls.append((done, total, label)),
    )
    assert calls[0] == (0, 10, "baseline") and calls[-1] == (10, 10, "done")
    doc = json.loads(json.dumps(result.to_dict()))  # plain numbers only
    excess = [p["excess_mean_kld"] for p in doc["parts"]]
    assert excess == sorted(excess, reverse=True)  # largest contribution first
    assert doc["sum_of_parts"]["mean_kld"] == pytest.approx(sum(excess))
    assert doc["whole_excess"]["mean_kld"] == pytest.approx(
        doc["whole"]["mean_kld"] - doc["baseline"]["mean_kld"]
    )
    text = result.format()
    lines = text.splitlines()
    assert "the file's weights for one class at a time" in lines[0]
    assert lines[2].split()[0] == doc["parts"][0]["group"]
    assert "sum of the parts" in text and "whole (all on)" in text and "baseline" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "noise"}, "attribution kind 'noise'"),
        ({"kind": "weights"}, "needs the F32 file"),
        ({"kind": "activations", "arithmetic": "q8"}, "must differ from q8"),
    ],
)
def test_bad_requests(tiny_variants, reference, kwargs, message):
    with pytest.raises(QllamaError, match=message):
        attribute(tiny_variants["Q8_0"], reference, **kwargs)


def test_a_reference_without_a_continuation_is_refused(tiny_variants, reference):
    bare = Reference(PROMPT, len(PROMPT), reference.logits[: len(PROMPT)])
    with pytest.raises(QllamaError, match="no continuation"):
        attribute(tiny_variants["Q8_0"], bare, kind="activations")


def test_attribute_command(tiny_variants, reference, tmp_path, capsys):
    reference.save(str(tmp_path / "ref.npz"))
    out = tmp_path / "a.json"
    argv = [
        "attribute",
        str(tiny_variants["untied-Q8_0"]),
        "--reference",
        str(tmp_path / "ref.npz"),
    ]
    # the untied file against the tied file's reference: different models, the same shapes
    assert main([*argv, "--kind", "activations", "--by", "tensor", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "q8 activations for one tensor at a time" in text and "output.weight" in text
    doc = json.loads(out.read_text())
    assert doc["by"] == "tensor" and len(doc["parts"]) == 1 + 2 * 7  # no token_embd
    # weights need the F32 file: with an .npz reference it must be named, before any work
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "--kind", "weights"])
    assert "needs --f32 (the F32 file)" in capsys.readouterr().err
    # the F32 file must be one: a quantized file is refused as the f32 weights
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "--kind", "weights", "--f32", str(tiny_variants["untied-Q8_0"])])
    assert "holds quantized tensors (" in capsys.readouterr().err
    assert main([*argv, "--kind", "weights", "--f32", str(tiny_variants["untied-F32"])]) == 0
    # --plot: the ranked groups as bars, a PNG; the JSON written first, whatever the plot does
    png, doc = tmp_path / "a.png", tmp_path / "b.json"
    argv += ["--kind", "activations", "--plot", str(png), "--top", "5", "--json", str(doc)]
    assert main(argv) == 0
    assert png.read_bytes().startswith(b"\x89PNG") and json.loads(doc.read_text())["parts"]


# --- by expert ---------------------------------------------------------------------------------

MOE = dict(arch="qwen3moe", head_dim=32, n_expert=3, n_ff_exp=32, n_layer=2, scale=0.3)


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory) -> dict[str, object]:
    """One random mixture as F32 and as Q4_0 (same seed: the same weights), and the F32 file's
    greedy continuation."""
    from qllama.synthetic import TinyConfig, write_tiny

    folder = tmp_path_factory.mktemp("moe-attribution")
    out: dict[str, object] = {}
    for kind in ("F32", "Q4_0"):
        out[kind] = folder / f"{kind}.gguf"
        write_tiny(out[kind], TinyConfig(**MOE, weight_type=kind), seed=5)
    f32 = qllama.load(out["F32"], dequantize_all=True)
    out["reference"] = reference_from_model(f32, PROMPT, max_new_tokens=NEW)
    return out


def test_an_expert_variant_is_the_file_with_those_slices_swapped(moe_files):
    """Every expert taken from the Q4_0 file is the F32 file with the three expert tensors
    taken whole (weights_from=); none taken is the F32 file itself."""
    from qllama.measure.attribution import with_experts

    f32, q4 = moe_files["F32"], moe_files["Q4_0"]
    base, donor = qllama.load(f32, activations="f32"), qllama.load(q4, activations="f32")
    every = [(i, e) for i in range(2) for e in range(3)]
    overlay = qllama.load(f32, activations="f32", weights_from={"blk.*.ffn_*_exps.weight": q4})
    ids = PROMPT * 3
    want = overlay.forward(ids, all_logits=True)
    assert (with_experts(base, donor, every).forward(ids, all_logits=True) == want).all()
    assert (
        with_experts(base, donor, []).forward(ids, all_logits=True)
        == base.forward(ids, all_logits=True)
    ).all()
    one = with_experts(base, donor, [(1, 2)])
    assert one.weights.layers[1].ffn_up_exps[2] is donor.weights.layers[1].ffn_up_exps[2]
    assert one.weights.layers[1].ffn_up_exps[1] is base.weights.layers[1].ffn_up_exps[1]
    assert one.weights.layers[0] is base.weights.layers[0]


def test_attribution_by_expert(moe_files):
    f32, q4, ref = moe_files["F32"], moe_files["Q4_0"], moe_files["reference"]
    result = attribute(q4, ref, kind="weights", by="expert", f32_path=f32)
    assert sorted(p.group for p in result.parts) == sorted(
        f"blk.{i}.expert{e}" for i in range(2) for e in range(3)
    )
    assert result.parts[0].tensors == [
        f"blk.0.{n}.weight[0]" for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    ]
    assert result.baseline == Measure.of(qllama.load(f32, activations="f32"), ref)
    whole = qllama.load(f32, activations="f32", weights_from={"blk.*.ffn_*_exps.weight": q4})
    assert result.whole == Measure.of(whole, ref)
    assert result.whole.mean_kld > result.baseline.mean_kld
    assert "blk.0.expert0" in result.format()
    # by class, the expert tensors (3-D) are groups as the 2-D ones are
    classes = attribute(q4, ref, kind="weights", by="class", f32_path=f32)
    exps = next(p for p in classes.parts if p.group == "ffn_up_exps")
    assert exps.tensors == ["blk.0.ffn_up_exps.weight", "blk.1.ffn_up_exps.weight"]
    assert exps.measure.mean_kld > classes.baseline.mean_kld
    with pytest.raises(QllamaError, match="by expert"):
        attribute(q4, ref, kind="activations", by="expert")
    from qllama.synthetic import TinyConfig, write_tiny

    dense = f32.parent / "dense.gguf"
    write_tiny(dense, TinyConfig(n_layer=2))
    with pytest.raises(QllamaError, match="same mixture"):
        attribute(q4, ref, kind="weights", by="expert", f32_path=dense)
