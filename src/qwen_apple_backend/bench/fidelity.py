"""Fidelity of a backend against ``stock``: teacher-forced top-1 agreement and perplexity.

Every backend reads the same real-text token ids (:data:`FIDELITY_TEXT`, an
English text written for this package and released with it under its licence)
from an empty context; at each of N >= 192 positions the backend's most likely
next token is compared with stock's. Perplexity is each backend's own, on the
text's actual next tokens. A second pass of each backend checks that it is
deterministic (``self_agreement``, exactly 1.0 for a deterministic backend).

With random weights the next-token distribution is nearly flat, so low
precision flips near-tied top-1 choices: compare agreement between runs of the
same precision, and read ``logits_rel_l2_vs_stock`` beside it.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Optional, Sequence

__all__ = ["FIDELITY_TEXT", "MIN_POSITIONS", "fidelity_ids", "run_fidelity", "teacher_forced"]

#: Fewest scored positions the report accepts as a fidelity measurement.
MIN_POSITIONS = 192

#: Written for this package (no third-party text); plain English prose, about 600 words.
FIDELITY_TEXT = """\
The lighthouse keeper's log for the first week of November begins with the weather, as every \
page of it does. A grey morning, wind from the south-west, a long swell running against the \
tide. The lamp was lit at a quarter to five in the afternoon and put out at seven the next \
morning. Nothing else is written for that day, and nothing else needed to be: the light had \
done its work, and no ship had come to harm.

People who visit the tower today often ask what the keepers did with the rest of their time. \
The answer is that the light was never finished. The brass had to be polished, because salt \
air turns it green within a week. The lens, a great beehive of glass prisms, had to be cleaned \
of soot each morning so that it would throw its beam as far as the maker had promised. The \
clockwork that turned the lens needed winding every few hours through the night, and a keeper \
who fell asleep at his post would wake to a dark sea and a stopped machine.

There were also the small repairs that any house needs, made harder by the fact that this house \
stood on a rock a mile from the shore. Paint, oil, bread and letters came out by boat when the \
sea allowed it, and sometimes it did not allow it for weeks. The keepers learned to bake, to \
mend their own boots and to keep a garden in a few square yards of soil carried out in sacks. \
One of them kept bees. Another taught himself to read music and played the fiddle badly for \
eleven winters, to the quiet suffering of his two colleagues.

The log records storms in the same plain hand as calm days. On the night of the great gale the \
entry is only slightly longer than usual. Waves broke over the gallery, it says, and one window \
of the lantern was cracked by a stone thrown up from the rock below. The keepers covered the \
window with a board, kept the lamp burning, and took turns sitting beside it until dawn. In the \
morning they counted the damage, wrote it down, and asked for a new pane of glass.

It is tempting to read these pages as a story about courage, and perhaps they are. But they are \
also a story about measurement. Every entry notes the time the lamp was lit and the time it was \
put out, the oil burned, the state of the sky and the sea. Over the years these numbers became a \
record of the coast itself: which months brought fog, how the winters changed, when the fishing \
boats came and went. A careful habit, kept for long enough, turns into knowledge that nobody \
set out to collect.

The last keeper left the tower when the light was made automatic. A small electric lamp now \
turns inside the old lens, and a sensor decides when the evening has come. It works well. It \
does not polish the brass, bake bread or write anything down, and on a stormy night there is \
no one to notice a cracked window. The log ends with a short line in the final keeper's hand: \
light handed over in good order, all instruments correct, weather fair.

Visitors who climb the stairs can still see the marks where the clockwork weights ran up and \
down the centre of the tower, and the hooks where the keepers hung their coats. From the \
gallery, on a clear day, the coast runs away on both sides, and the sea looks calm enough to \
walk on. It rarely is. That, in the end, is why the light was built, and why someone once \
thought it worth the trouble to write down, every single day, that it had been lit.
"""


def fidelity_ids(tokenizer: Any, vocab_size: int, positions: int = 256,
                 text: str = FIDELITY_TEXT) -> tuple[list[int], dict]:
    """Token ids of the fidelity text: ``positions + 1`` ids (inputs plus the last target).

    Args:
        tokenizer: object with ``encode(text)``; None uses the text's UTF-8 bytes as ids
            (for a model without a tokenizer at hand; recorded).
        vocab_size (int): the model's vocabulary; ids at or above it are folded
            modulo ``vocab_size`` (small-vocabulary test models; recorded).
        positions (int): scored positions N. Default 256.
        text (str): the text. Default :data:`FIDELITY_TEXT`.

    Returns:
        tuple[list[int], dict]: ids, and how they were made (``tokenizer``,
        ``folded_mod``, ``text_sha256``, ``available_positions``).

    Raises:
        ValueError: if ``positions`` < 1.
    """
    if positions < 1:
        raise ValueError(f"fidelity positions must be >= 1, got {positions}")
    if tokenizer is None:
        ids = list(text.encode("utf-8"))
        how = "utf-8 bytes (no tokenizer available)"
    else:
        ids = list(tokenizer.encode(text))
        how = type(getattr(tokenizer, "_tokenizer", tokenizer)).__name__
    available = len(ids) - 1
    ids = ids[: positions + 1]
    info: dict[str, Any] = {
        "tokenizer": how,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "text_chars": len(text),
        "available_positions": available,
        "folded_mod": None,
    }
    if ids and max(ids) >= vocab_size:
        ids = [i % vocab_size for i in ids]
        info["folded_mod"] = vocab_size
    return ids, info


def teacher_forced(logits: Any, targets: Sequence[int]) -> dict:
    """Top-1 predictions and negative log-likelihoods of teacher-forced logits.

    Shapes:
        logits: [N, V] float32 (row t predicts ``targets[t]``); targets: [N].

    Returns:
        dict: ``top1`` (numpy int64 [N]), ``nll`` (numpy float64 [N]).
    """
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    t = np.asarray(targets, dtype=np.int64)
    m = x.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[:, 0]
    nll = lse - x[np.arange(len(t)), t]
    return {"top1": x.argmax(axis=-1), "nll": nll}


def run_fidelity(targets: Sequence[Any], ids: Sequence[int], *, baseline: str = "stock",
                 repeat: bool = True, progress: Optional[Any] = None) -> dict:
    """Teacher-forced agreement of every target with the baseline, and perplexities.

    Args:
        targets (Sequence[BenchTarget]): the backends (any order).
        ids (Sequence[int]): N + 1 token ids; positions 0..N-1 are inputs.
        baseline (str): label of the reference. Default ``"stock"``; when absent, the
            first target is the reference.
        repeat (bool): run each target twice and record ``self_agreement``. Default True.
        progress (optional): a tqdm bar to advance once per pass.

    Returns:
        dict: ``positions``, ``baseline``, and per label: ``agreement_vs_stock``,
        ``agreeing_positions``, ``first_disagreement``, ``self_agreement``,
        ``perplexity``, ``nll_mean``, ``logits_rel_l2_vs_stock``,
        ``logits_max_abs_diff_vs_stock``.

    Raises:
        ValueError: if fewer than 2 ids are given.
    """
    import numpy as np

    if len(ids) < 2:
        raise ValueError("fidelity needs at least 2 token ids")
    inputs, tgt = list(ids[:-1]), list(ids[1:])
    ref_target = next((t for t in targets if t.label == baseline), targets[0])
    order = [ref_target] + [t for t in targets if t is not ref_target]
    ref_logits = None
    ref_top1 = None
    out: dict[str, Any] = {"positions": len(tgt), "baseline": ref_target.label, "backends": {}}
    for t in order:
        t.reset()
        logits = np.asarray(t.logits(inputs), dtype=np.float32)
        if progress is not None:
            progress.update(1)
        scored = teacher_forced(logits, tgt)
        rec: dict[str, Any] = {
            "perplexity": float(math.exp(float(scored["nll"].mean()))),
            "nll_mean": float(scored["nll"].mean()),
        }
        if repeat:
            t.reset()
            again = np.asarray(t.logits(inputs), dtype=np.float32)
            if progress is not None:
                progress.update(1)
            rec["self_agreement"] = float((again.argmax(-1) == scored["top1"]).mean())
            rec["self_logits_max_abs_diff"] = float(np.abs(again - logits).max())
        if ref_logits is None:
            ref_logits, ref_top1 = logits, scored["top1"]
        same = scored["top1"] == ref_top1
        mismatch = np.flatnonzero(~same)
        rec["agreement_vs_stock"] = float(same.mean())
        rec["agreeing_positions"] = int(same.sum())
        rec["first_disagreement"] = int(mismatch[0]) if mismatch.size else None
        denom = float(np.linalg.norm(ref_logits))
        rec["logits_rel_l2_vs_stock"] = (float(np.linalg.norm(logits - ref_logits)) / denom
                                         if denom > 0 else 0.0)
        rec["logits_max_abs_diff_vs_stock"] = float(np.abs(logits - ref_logits).max())
        ppl_ref = out["backends"].get(ref_target.label, rec)["perplexity"]
        rec["perplexity_rel_vs_stock"] = rec["perplexity"] / ppl_ref - 1.0
        out["backends"][t.label] = rec
        t.reset()
    out["backends"] = {t.label: out["backends"][t.label] for t in targets}
    return out
