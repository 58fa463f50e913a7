"""The confidence a user sees (qkv.inspect.trust, qkv.inspect.calibrate): never falling as the mean token
log-probability rises, fitted on the model's own translations with a feature only where it ranks
better and no made-up pathology worse, flags fitted on the model's own acceptable output, the omission
score, each checkpoint's own (or log-probability only), judging exactly what the model translated,
and repeat counts that stay linear in a line."""

from __future__ import annotations

import json
import math
import random
import shutil
import time

import pytest

import qkv
from qkv.data.sentences import TextOptions
from qkv.errors import QkvError
from qkv.inspect.calibrate import (
    KINDS, MAX_FALSE_ALARMS, MAX_FALSE_REFERENCES, MIN_CLASS, QUANTILES, fit, fit_length, omission_table,
)
from qkv.inspect.trust import (
    CAP_FACTOR, CONFIDENCE, FEATURES, FLAG_CAP, FLAGS, LOGPROB_ONLY, Trust, assess, assess_lines, calibration_of, char_repeats,
    check_calibration, confidence_of, ending_ids, flags_of, load_calibration, max_repeats, omission_score,
    recurrence, uncovered, why_flagged,
)
from qkv.io import checkpoint


def _trust(**features) -> Trust:
    return Trust(0.5, [], {f: features.get(f, 0.0) for f in FEATURES})


def _own(n: int, seed: int = 0, *, lp_sign: float = 1.0) -> tuple[list[Trust], list[float]]:
    """n translations whose chrF follows their log-probability (times lp_sign) and their shortness,
    with a feature (copy) that is noise."""
    rng = random.Random(seed)
    trusts, chrf = [], []
    for _ in range(n):
        lp, short, noise = rng.uniform(-3, -0.2), rng.choice([0.0, 0.0, 0.0, rng.uniform(0.3, 1.0)]), rng.random()
        trusts.append(_trust(logprob_mean=lp, shortness=short, copy=noise, logprob_min=lp - 2, source_mean=0.6))
        chrf.append(max(0.0, min(100.0, 60 + lp_sign * 20 * (lp + 1.6) - 60 * short + rng.gauss(0, 8))))
    return trusts, chrf


def _grid(calibration: dict, **fixed) -> list[float]:
    base = {f: 0.0 for f in FEATURES} | fixed
    return [confidence_of(base | {"logprob_mean": lp / 10}, calibration, flags_of(base | {"logprob_mean": lp / 10}, calibration["thresholds"]))
            for lp in range(-80, 1)]


def test_the_confidence_never_falls_as_the_mean_log_probability_rises():
    # Data where a higher log-probability means a worse translation: an unconstrained fit would weigh it below 0
    own, chrf = _own(300, lp_sign=-1.0)
    fitted = fit(own, chrf, name="anti")
    assert fitted["kind"] == "fitted" and fitted["weights"][fitted["features"].index("logprob_mean")] >= 0
    normal = fit(*_own(300), name="normal")
    assert normal["weights"][0] > 0
    for calibration in (fitted, normal, LOGPROB_ONLY):
        for fixed in ({}, {"shortness": 0.8, "copy": 0.5}, {"repeats": 9.0}):
            values = _grid(calibration, **fixed)
            assert all(a <= b for a, b in zip(values, values[1:])), (calibration["fitted_on"], fixed)
    assert max(_grid(LOGPROB_ONLY, repeats=9.0)) == FLAG_CAP  # a loop caps it
    assert _grid(LOGPROB_ONLY)[0] == pytest.approx(math.exp(-8))  # log-probability only: exp(logprob_mean)
    broken = dict(normal, weights=[-1.0, *normal["weights"][1:]])
    with pytest.raises(QkvError, match="not a calibration"):
        check_calibration(broken, "confidence.json")


def _with_entropy(n: int, weight: float, seed: int = 0) -> tuple[list[Trust], list[float]]:
    """n translations whose chrF follows their log-probability and, by ``weight``, falls with their
    attention entropy."""
    rng = random.Random(seed)
    trusts, chrf = [], []
    for _ in range(n):
        lp, entropy = rng.uniform(-3, -0.2), rng.uniform(0.3, 0.9)
        trusts.append(_trust(logprob_mean=lp, attention_entropy=entropy, repeats=1.0, source_mean=0.6))
        chrf.append(60 + 20 * (lp + 1.6) - weight * 100 * (entropy - 0.6) + rng.gauss(0, 8))
    return trusts, chrf


def _made(entropy_of_detached: float, n: int = 100) -> tuple[list[Trust], list[str]]:
    """Labelled pairs of every kind: the references at entropy 0.6, the detached ones at ``entropy_of_detached``
    and a log-probability a little under theirs."""
    rng = random.Random(5)
    made, kinds = [], []
    for _ in range(n):
        lp = rng.uniform(-2.5, -1.0)
        for kind in KINDS:
            features = {"logprob_mean": lp - (0.3 if kind != "correct" else 0.0), "attention_entropy": 0.6, "repeats": 1.0,
                        "source_mean": rng.uniform(0.4, 0.7), "source_min": rng.uniform(0.3, 0.6)}
            if kind == "detached":
                features["attention_entropy"] = entropy_of_detached
            made.append(_trust(**features))
            kinds.append(kind)
    return made, kinds


def test_a_feature_joins_the_confidence_only_where_it_ranks_validation_better_and_no_made_up_pathology_worse():
    informative = fit(*_with_entropy(600, 0.5), name="entropy matters")
    assert informative["features"] == ["logprob_mean", "attention_entropy"]
    assert informative["combination"]["held_out_gain"] > 0
    assert informative["given"]["roc_auc"] > informative["logprob"]["roc_auc"]
    noise = fit(*_with_entropy(600, 0.0), name="entropy is noise")
    assert noise["features"] == ["logprob_mean"]  # the calibrated log-probability ...
    assert noise["given"]["roc_auc"] == pytest.approx(noise["logprob"]["roc_auc"])  # ... ranks exactly as it
    # The same informative translations, but entropy ranks detached made-up pairs above the references: refused
    guarded = fit(*_with_entropy(600, 0.5), name="guarded", made=_made(0.3)[0], kinds=_made(0.3)[1])
    assert guarded["features"] == ["logprob_mean"]
    allowed = fit(*_with_entropy(600, 0.5), name="allowed", made=_made(0.9)[0], kinds=_made(0.9)[1])
    assert allowed["features"] == ["logprob_mean", "attention_entropy"]


def test_a_calibration_caps_only_at_the_flags_its_fit_chose_and_an_older_one_as_before():
    calibration = fit(*_own(300), name="normal") | {"capping": ["repetition"]}
    check_calibration(calibration, "confidence.json")
    features = {f: 0.0 for f in FEATURES} | {"logprob_mean": -0.3, "repeats": 9.0, "copy": 0.95}
    plain = confidence_of(features, calibration, [])
    assert plain > FLAG_CAP and confidence_of(features, calibration, ["copy", "detached"]) == plain  # a severe copy: no cap
    assert confidence_of(features, calibration, ["repetition"]) == pytest.approx(plain * CAP_FACTOR)
    older = {k: v for k, v in calibration.items() if k not in ("version", "combination")} | {"version": 2, "capping": ["detached"]}
    check_calibration(older, "confidence.json")
    assert confidence_of(features | {"repeats": 1.0, "copy": 0.0}, older, ["detached"]) == FLAG_CAP
    assert confidence_of(features, older, []) == FLAG_CAP  # a severe loop or copy caps a version 2 calibration
    with pytest.raises(QkvError, match="not a calibration"):
        check_calibration(calibration | {"capping": ["omission"]}, "confidence.json")


def test_a_flag_caps_only_where_capping_ranks_validation_better_in_and_out_of_fold_and_no_pathology_worse():
    rng = random.Random(11)
    own, chrf = _own(600, seed=4)
    made, kinds = _made(0.6, n=300)
    for t in own:
        t.features["copy"] = rng.uniform(0.0, 0.3)
    for t, c in zip(own, chrf):  # loops on 8% of the bad translations, and on a few good ones
        t.features["repeats"] = 8.0 if (c < 40 and rng.random() < 0.08) or rng.random() < 0.003 else 1.0
    for t, kind in zip(made, kinds):
        t.features["repeats"] = 6.0 if kind == "oscillation" else 1.0
        t.features["copy"] = 0.95 if kind == "copy" else rng.uniform(0.0, 0.3)
    calibration = fit(own, chrf, name="loops on bad lines", made=made, kinds=kinds)
    steps = {s["flag"]: s for s in calibration["capping_selection"]}
    assert calibration["capping"] == ["repetition"] and steps["repetition"]["held_out_gain"] > 0
    assert steps["repetition"]["references_over"][1]["oscillation"] > steps["repetition"]["references_over"][0]["oscillation"]
    assert not steps["copy"]["caps"]  # flags no own translation: nothing gained
    assert calibration["given"]["roc_auc"] > calibration["logprob"]["roc_auc"]
    for i, (t, c) in enumerate(zip(own, chrf)):  # now the loops fall on a few good translations only: capping ranks worse
        t.features["repeats"] = 8.0 if c >= 60 and i % 150 == 0 else 1.0
    worse = fit(own, chrf, name="loops on good lines", made=made, kinds=kinds)
    assert worse["thresholds"]["repetition"] == 3.5 and worse["capping"] == []  # halfway from 1 (own) to 6 (made-up)


def test_each_flag_trips_on_at_most_its_share_of_the_acceptable_translations_and_the_references(tmp_path):
    rng = random.Random(7)
    own, chrf = _own(800, seed=2)
    for t in own:  # loops of 2 on a few translations, the model's own acceptable ones among them
        t.features["repeats"] = 2.0 if rng.random() < 0.05 else 1.0
        t.features["copy"] = rng.uniform(0.0, 0.3)
        draw = rng.random()  # a phrase twice in about 3% of them, thrice in about 0.3%
        t.features["recurrence"] = 2.0 if draw < 0.003 else 1.0 if draw < 0.035 else 0.0
        t.features["longness"] = rng.uniform(0.0, 0.5) if rng.random() < 0.05 else 0.0  # a few longer than expected
    made, kinds = _made(0.6, n=400)
    for t, kind in zip(made, kinds):
        t.features["repeats"] = 5.0 if kind == "oscillation" else 1.0
        t.features["copy"] = 0.95 if kind == "copy" else rng.uniform(0.0, 0.3)
        t.features["recurrence"] = rng.choice([2.0, 3.0]) if kind == "oscillation" else 0.0
        t.features["longness"] = rng.uniform(0.3, 0.8) if kind == "addition" else 0.0
    calibration = fit(own, chrf, name="flags", made=made, kinds=kinds)
    alarms = calibration["false_alarms"]
    for flag in FLAGS:
        assert alarms[flag]["own_acceptable"] <= MAX_FALSE_ALARMS and alarms[flag]["references"] <= MAX_FALSE_REFERENCES
    # 2 repeats trips 5% of the acceptable ones: the cut lies above them, halfway to the made-up loops' 5
    assert calibration["thresholds"]["repetition"] == 3.5
    # the lowest cut within 1% of the acceptable ones: 1 trips more of them, 2 few enough
    accepted = [t for t, c in zip(own, chrf) if c >= 50]
    at = lambda cut: sum(t.features["recurrence"] >= cut for t in accepted) / len(accepted)  # noqa: E731
    assert at(1) > MAX_FALSE_ALARMS >= at(2) > 0
    assert calibration["thresholds"]["recurrence"] == 1.5 and alarms["recurrence"]["caught"] == 1.0  # halfway from 1 to 2
    # addition: halfway between the lowest longness (of any pair) that at most 1% of the acceptable ones
    # reach and the acceptable value below it, which more than 1% reach
    cut = calibration["thresholds"]["addition"]
    share = lambda c: sum(t.features["longness"] >= c for t in accepted) / len(accepted)  # noqa: E731
    below = max(t.features["longness"] for t in accepted if t.features["longness"] < cut)  # the next acceptable value down
    added = [t.features["longness"] for t, k in zip(made, kinds) if k == "addition"]
    lowest = min(v for v in added + [t.features["longness"] for t in accepted] if v > cut)
    assert cut == (below + lowest) / 2 and 0 < share(cut) <= MAX_FALSE_ALARMS < share(below)
    assert alarms["addition"]["caught"] == sum(v >= cut for v in added) / len(added) and 0.5 < alarms["addition"]["caught"] < 1.0
    assert alarms["repetition"]["caught"] == 1.0 and alarms["copy"]["caught"] == 1.0
    # detached made-up pairs read like the references (source_mean drawn alike): no cut catches half: never flags
    assert calibration["thresholds"]["detached"] is None and alarms["detached"]["caught"] == 0.0
    path = tmp_path / "confidence.json"
    path.write_text(json.dumps(calibration))
    assert load_calibration(path)["false_alarms"] == alarms


def test_the_omission_score_ranks_a_translation_among_the_models_own():
    own = [_trust(uncovered=u / 100, eos_logprob=-e / 100) for u in range(100) for e in (5, 50)]
    table = omission_table(own)
    assert len(table["uncovered"]) == len(table["eos_logprob"]) == QUANTILES and table["uncovered"] == sorted(table["uncovered"])
    calibration = {"omission": table}
    low = omission_score({"uncovered": 0.0, "eos_logprob": -0.01}, calibration)
    high = omission_score({"uncovered": 2.0, "eos_logprob": -9.0}, calibration)
    middle = omission_score({"uncovered": 0.5, "eos_logprob": -0.05}, calibration)
    assert 0.0 <= low < middle < high == 1.0
    assert omission_score({"uncovered": 2.0, "eos_logprob": -9.0}, LOGPROB_ONLY) == 0.0  # no table: nothing to rank against
    assert uncovered([1.0, 0.2, 0.0], [True, True, False]) == pytest.approx(0.4)  # punctuation (False) weighs nothing


def test_calibration_judges_a_line_whole_or_by_its_sentences_as_asked(random_checkpoint, tmp_path, monkeypatch):
    """qkv calibrate judges each validation line whole, as qkv score --confidence reads a line (the
    module docstring says why); calibrate(text=...) cuts a line into sentences and recases them as
    qkv translate does and judges it by its sentences as the model read and wrote them."""
    import qkv.inspect.trust as trust
    from qkv.data.sentences import TextOptions
    from qkv.inspect.calibrate import calibrate, calibrate_checkpoint

    seen = []
    real = trust.assess_lines
    monkeypatch.setattr(trust, "assess_lines", lambda model, tok, sources, translations, **kw: seen.append(sources) or real(
        model, tok, sources, translations, **kw))
    target = shutil.copytree(random_checkpoint, tmp_path / "model")
    sources = ["A dog runs. A CAT SLEEPS.", "Two children play with a red ball."]
    calibration = calibrate_checkpoint(target, sources, ["Ein Hund rennt. Eine Katze schläft.", "Zwei Kinder spielen."],
                                       name="two lines", log=lambda text: None)
    assert seen[0][:2] == [["A dog runs. A CAT SLEEPS."], ["Two children play with a red ball."]]
    assert calibration["text"] is None and json.loads((target / "confidence.json").read_text())["text"] is None
    loaded = checkpoint.load(target)
    cut = calibrate(loaded.model, loaded.tokenizer, sources, ["Ein Hund rennt. Eine Katze schläft.", "Zwei Kinder spielen."],
                    name="two lines", text=TextOptions(split="en", recase=True), log=lambda text: None)
    assert seen[1][:2] == [["A dog runs.", "A cat sleeps."], ["Two children play with a red ball."]]
    assert cut["text"] == {"split": "en", "recase": True}


def test_too_few_translations_of_one_kind_give_a_log_probability_confidence():
    """The dates model translates all its validation dates right: nothing to fit, no borrowed fit."""
    own, _ = _own(50)
    calibration = fit(own, [100.0] * 50, name="dates")
    assert calibration["kind"] == "logprob" and str(50) in calibration["why"]
    assert calibration["thresholds"] == LOGPROB_ONLY["thresholds"]  # no labelled pairs: the flags that read the text
    assert confidence_of(own[0].features, calibration) == pytest.approx(math.exp(own[0].features["logprob_mean"]))
    check_calibration(calibration, "confidence.json")
    almost = fit(own, [100.0] * (50 - MIN_CLASS + 1) + [0.0] * (MIN_CLASS - 1), name="dates")
    assert almost["kind"] == "logprob"


def test_the_expected_length_is_a_line_through_the_log_word_counts():
    a, b = fit_length(["a b c", "a b c d e f g"], ["x y y y y y", "x y y y y y y y y y y y y y"])
    assert a + b * math.log(4) == pytest.approx(math.log(7)) and a + b * math.log(8) == pytest.approx(math.log(15))
    assert fit_length(["a b", "c d"], ["x", "y"]) == pytest.approx([math.log(2) - math.log(3), 1.0])


def test_repeat_counts_are_linear_in_the_line():
    # a b a b a b: 3; the old quadratic count took longer than 45 s on 30,000 repeats (issue 72 #12)
    assert max_repeats("a b a b a b c".split()) == 3 and max_repeats(["x"]) == 1 and max_repeats([]) == 0
    started = time.monotonic()
    assert max_repeats(["Haus"] * 30_000) == 30_000
    assert max_repeats("ein Hund und".split() * 10_000) == 10_000
    assert char_repeats("E" * 30_000) == 29_998 and char_repeats("ab" * 15_000) == 14_998
    assert char_repeats("Motorrollrollrollroll") == 2 and char_repeats("Skimboardboardboardboard") == 2  # units of four and five
    assert char_repeats("Schifffahrt") == 1 and char_repeats("Kinderkinder") == 1  # German's own: no loop
    assert time.monotonic() - started < 10


def test_each_checkpoint_has_its_own_confidence_or_the_log_probability(random_checkpoint, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(random_checkpoint, model_dir)
    assert calibration_of(model_dir) is LOGPROB_ONLY  # never another model's fit
    loaded = qkv.load_checkpoint(model_dir)
    sources, translations = ["A dog runs across the green field."], ["Ein Hund rennt über die grüne Wiese."]
    (plain,) = qkv.assess(loaded.model, loaded.tokenizer, sources, translations)
    assert plain.confidence == pytest.approx(math.exp(plain.features["logprob_mean"]))
    own = fit(*_own(200), name="its own")
    checkpoint.add_file(model_dir, CONFIDENCE, lambda path: path.write_text(json.dumps(own)))
    reloaded = qkv.load_checkpoint(model_dir)
    (mine,) = qkv.assess(reloaded.model, reloaded.tokenizer, sources, translations)  # the checkpoint's calibration, read
    assert mine.confidence == pytest.approx(confidence_of(mine.features, own, mine.flags))
    assert mine.confidence != pytest.approx(plain.confidence)
    (given,) = assess(reloaded.model, reloaded.tokenizer, sources, translations, calibration=LOGPROB_ONLY)
    assert given.confidence == pytest.approx(plain.confidence)


def test_the_trust_pass_reads_the_sentences_the_model_translated(random_checkpoint):
    """A line in capitals with two sentences is judged sentence by sentence, in the case the model read."""
    translator = qkv.Translator.from_checkpoint(random_checkpoint, text=TextOptions(split="en", recase=True))
    line = "TWO CHILDREN PLAY WITH A RED BALL. A DOG RUNS ACROSS THE GREEN FIELD."
    ((text, trust),) = qkv.translate_with_confidence(translator, [line])
    (done,) = translator.translate_lines([line])
    assert text == done.text == translator.translate([line])[0]
    assert done.sentences == ["Two children play with a red ball.", "A dog runs across the green field."]
    assert done.text == " ".join(o.upper() for o in done.outputs)  # written back in capitals
    sentences = assess(translator.model, translator.tokenizer, done.sentences, done.outputs)
    assert trust.confidence == min(t.confidence for t in sentences)
    assert trust.words == [w for t in sentences for w in t.words]
    (whole,) = assess(translator.model, translator.tokenizer, [line], [text])  # the raw line: not what was translated
    assert whole.features != trust.features
    (again,) = assess_lines(translator.model, translator.tokenizer, [done.sentences], [done.outputs])
    assert again.confidence == trust.confidence and again.flags == trust.flags


def test_an_empty_translation_of_a_line_is_an_omission(random_checkpoint):
    loaded = qkv.load_checkpoint(random_checkpoint)
    empty, blank = assess(loaded.model, loaded.tokenizer, ["A dog runs across the green field.", ""], ["", ""])
    assert "omission" in empty.flags and empty.confidence <= FLAG_CAP and empty.why["omission"] == "the translation is empty"
    assert blank.flags == [] and blank.confidence == 1.0


def test_each_reason_names_its_feature_its_value_and_the_threshold_crossed():
    features = {"source_mean": 0.1, "source_min": 0.05, "repeats": 3.0, "copy": 0.2, "unused": 0.0}
    thresholds = {"detached": 0.2, "partly-detached": 0.1, "repetition": 2.0, "copy": 0.9, "omission": None}
    flags = flags_of(features, thresholds)
    assert flags == ["detached", "repetition"]  # detached, so not also partly detached; no omission cut
    why = why_flagged(flags, features, thresholds)
    assert why["detached"].endswith("(source_mean) is 0.100, below 0.200")
    assert why["repetition"].endswith("(repeats) is 3.000, at or above 2.000")


def test_a_phrase_that_recurs_apart_is_counted_beyond_the_sources_own_repeats():
    wandering = ("Ein Mann mit einem schwarzen T-Shirt und eine Frau mit einem schwarzen T-Shirt spielen, "
                 "während ein Kind mit einem schwarzen T-Shirt singt.")
    assert max_repeats(wandering.split()) == 1  # never back to back: the repetition flag cannot see it
    assert recurrence("A man and a woman play while a child sings.", wandering) == 2  # "mit einem schwarzen" thrice
    # a source that repeats a phrase allows the translation as many
    assert recurrence("a dog and a dog and a dog", "ein Hund und ein Hund und ein Hund") == 0
    assert recurrence("Hi", "") == 0 and recurrence("", "a b c a b c") == 1
    started = time.monotonic()
    assert recurrence("x", "ein roter Ball " * 20_000) == 19_999  # linear in the words
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("missing", [("recurrence", "addition"), ("addition",)])
def test_an_older_calibration_without_the_later_flags_loads_and_never_raises_them(tmp_path, missing):
    """A calibration fitted before ``recurrence`` (2026-12-06) or before ``addition`` (2026-12-07) existed."""
    older = fit(*_own(300), name="normal")
    older["thresholds"] = {k: v for k, v in older["thresholds"].items() if k not in missing}
    path = tmp_path / "confidence.json"
    path.write_text(json.dumps(older))
    loaded = load_calibration(path)
    features = {f: 0.0 for f in FEATURES} | {"recurrence": 50.0, "longness": 5.0}
    for flag in missing:
        assert loaded["thresholds"][flag] is None and flag not in flags_of(features, loaded["thresholds"])
    assert {"recurrence", "addition"} <= set(flags_of(features, loaded["thresholds"] | {"recurrence": 2.0, "addition": 0.5}))
    with pytest.raises(QkvError, match="not a calibration"):  # a flag every calibration has cannot be missing
        check_calibration(older | {"thresholds": {k: v for k, v in older["thresholds"].items() if k != "copy"}}, "x")


def test_ending_where_the_translation_ends_counts_its_full_stop(random_checkpoint):
    """eos_logprob is the log-probability of the end of sentence or of a sentence-final punctuation mark
    where the translation ends (so a translation without its full stop is not read as cut short)."""
    import torch

    loaded = qkv.load_checkpoint(random_checkpoint)
    model, tok = loaded.model, loaded.tokenizer
    ids = ending_ids(tok)
    assert ids[0] == tok.eos_id and all(p.lstrip("\u2581") in ".!?…。！？" for p in tok.pieces(ids[1:]))
    source, translation = "A dog runs.", "Ein Hund rennt"
    (trust,) = assess(model, tok, [source], [translation], calibration=LOGPROB_ONLY)
    src = torch.tensor([tok.encode(source) + [tok.eos_id]])
    tgt_in = torch.tensor([[tok.bos_id] + tok.encode_target(translation)])
    with torch.inference_mode():
        last = model(src, tgt_in)[0, -1].float().log_softmax(-1)  # (V,): after the last word
    assert trust.features["eos_logprob"] == pytest.approx(float(last[ids].logsumexp(-1)), abs=1e-4)
    if len(ids) > 1:  # at least the end of sentence's own log-probability, more by the marks'
        assert trust.features["eos_logprob"] > float(last[tok.eos_id])


def test_the_light_pass_gives_the_full_passs_confidence_flags_and_features(random_checkpoint):
    """What qkv translate --confidence prints (no words) comes from the plain pass where the calibration
    reads no source share; where it does, the full pass runs all the same."""
    loaded = qkv.load_checkpoint(random_checkpoint)
    sources = ["A dog runs across the green field.", "Two children play with a red ball on the beach .", "Hi",
               "An old man in a red coat sells fresh bread and cheese at the market near the harbour."]
    translations = ["Ein Hund rennt über die grüne Wiese.", "Zwei Kinder spielen Kinder Kinder Kinder Kinder Kinder.", "Hallo",
                    "Ein Mann."]
    own = [_trust(logprob_mean=-1.0 - i / 50, uncovered=i / 100, eos_logprob=-i / 20) for i in range(60)]
    calibration = fit(own, [100.0 - i for i in range(60)], name="light") | {
        "thresholds": {"detached": None, "partly-detached": None, "repetition": 3.0, "copy": 0.5, "omission": 0.9}}
    full = assess(loaded.model, loaded.tokenizer, sources, translations, calibration=calibration)
    light = assess(loaded.model, loaded.tokenizer, sources, translations, calibration=calibration, words=False)
    for a, b in zip(full, light):
        assert (a.confidence, a.flags) == (b.confidence, b.flags) and a.words and not b.words
        assert set(a.features) - set(b.features) == {"source_mean", "source_min", "unused"}
        assert all(b.features[k] == pytest.approx(a.features[k], abs=1e-6) for k in b.features)
    assert "repetition" in light[1].flags and light[3].features["uncovered"] > 0.3  # a long source, two words back
    shares = calibration | {"thresholds": calibration["thresholds"] | {"detached": 0.1}}
    (needed,) = assess(loaded.model, loaded.tokenizer, sources[:1], translations[:1], calibration=shares, words=False)
    assert "source_mean" in needed.features  # the detached flag reads a source share: the full pass


def test_an_older_calibrations_omission_flag_no_longer_fires(tmp_path):
    """A version 2 confidence.json thresholded omission on ``unused``; the feature of that name is now the
    omission score, so the old threshold is dropped when the file is read (docs/trust.md)."""
    older = fit(*_own(300), name="normal") | {"version": 2, "capping": ["detached"]}
    older["thresholds"] = older["thresholds"] | {"omission": 0.08}
    path = tmp_path / "confidence.json"
    path.write_text(json.dumps(older))
    loaded = load_calibration(path)
    assert loaded["thresholds"]["omission"] is None and loaded["thresholds"]["repetition"] == older["thresholds"]["repetition"]
    assert "omission" not in flags_of({f: 0.0 for f in FEATURES} | {"omission": 1.0, "unused": 1.0}, loaded["thresholds"])
