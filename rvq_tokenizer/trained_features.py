"""The features a codec was trained on, as its checkpoint records them (tools.extract's settings: fbank, or the
w2v-BERT model, layer, chunk length and precision, the fbank's front-end, the dump's dtype), and what computes them
again (the fbank and the w2v-BERT layer): what tools.tokenize and rvq_tokenizer make codes from. A setting given
(a flag, a keyword) must be the codec's: another is refused, naming both, since codes of other features would be
meaningless."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from data.audio.features import FEATURES, FRONT_ENDS, SeamlessFbank, W2vBertLayer
from data.audio.pass_plan import w2v_attention
from data.feature_settings import RECORDED_BEFORE, describe, front_end, model_fingerprint, settings_differ
from errors import COMMAND_LINE, Asker, BadInputError
from training.device import precision_names

log = logging.getLogger(__name__)

PRECISION_NAMES = precision_names("fp32", "bf16")  # --precision -> the name tools.extract records


@dataclasses.dataclass(frozen=True)
class FeatureFlags:
    """The features' flags: each None, the codec's own (a given one must be the codec's); w2v_bert: where its
    model lies on this machine; asker: who gave them (the command line's flags, or rvq_tokenizer's keywords), as
    the messages name them."""

    feature: str | None
    layer: int | None
    precision: str | None  # fp32 or bf16 (PRECISION_NAMES)
    w2v_bert: Path | None
    asker: Asker = COMMAND_LINE


def trained_features(state: dict, ckpt_path: Path, flags: FeatureFlags) -> dict:
    """The feature settings the checkpoint records, checked against --feature, --layer and --precision."""
    trained = (state.get("config") or {}).get("features") or {}
    if trained.get("feature") not in FEATURES:
        who = "rvq_tokenizer" if flags.asker.python else "tokenize"
        raise BadInputError(f"the codec in {ckpt_path} was trained on {describe(trained)}: {who} computes only "
                            "features tools.extract wrote from audio, as the checkpoint of a run on them records "
                            "(trainers before this one recorded none); the codes of such features come from python -m "
                            "tools.encode")
    given = {k: v for k, v in (("feature", flags.feature), ("layer", flags.layer), ("precision", flags.precision))
             if v is not None}
    asked = {k: PRECISION_NAMES.get(v) if k == "precision" else v for k, v in given.items()}  # as notes say them
    differ = settings_differ(trained, {**trained, **asked})
    if differ:  # the flags that differ, and the fix: the codec's own settings are the default
        other = [flags.asker.option(k, given[k]) for k in asked if trained.get(k) != asked[k]]
        raise BadInputError(f"the codec in {ckpt_path} was trained on {describe(trained)}; the settings given ask "
                            f"for {asked.get('feature', trained['feature'])} features ({differ}): its codes of other "
                            f"features would be meaningless. Leave out {' '.join(other)}: the codec's are the default")
    return trained


def feature_maker(trained: dict, flags: FeatureFlags, device: torch.device, ckpt_path: Path,
                  before_pass_rules: bool, *, compile: bool,
                  graphs: bool = False) -> tuple[SeamlessFbank, W2vBertLayer | None, dict]:
    """(the fbank, the w2v-BERT layer or None, the settings of the features they make), the latter the codec's;
    w2v-BERT from the folder flags.w2v_bert (None: the one the codec records), under torch.compile with `compile`,
    in graph mode with `graphs`, for a shard begun `before_pass_rules` or not (rvq_tokenizer/pipeline_settings.py)."""
    computed = codec_front_end(trained)
    if trained["feature"] != "w2v-bert":
        return SeamlessFbank(None, computed), None, trained
    folder = flags.w2v_bert or Path(trained["checkpoint"])
    if not folder.is_dir():
        raise BadInputError(f"the codec in {ckpt_path} was trained on {describe(trained)}, and {folder} is not a "
                            f"folder here: give the model's folder with {flags.asker.option('w2v_bert', 'DIR')}")
    encoder = W2vBertLayer(folder, trained["layer"], device=device, dtype=getattr(torch, trained["precision"]),
                           max_chunk_seconds=trained["max_chunk_seconds"], flag="w2v_bert", asker=flags.asker,
                           attention=w2v_attention(before_pass_rules),
                           compile=compile, graphs=graphs)
    now = {**trained, "dim": encoder.dim, "checkpoint": str(folder.resolve()), "model": model_fingerprint(folder)}
    differ = settings_differ(trained, now)
    if differ:
        raise BadInputError(f"the codec in {ckpt_path} was trained on {describe(trained)}; "
                            f"{flags.asker.option('w2v_bert', folder)} gives {describe(now)} ({differ})")
    log.info("w2v-bert layer %d of %s on %s (%s), %d-d%s", encoder.layer, folder, encoder.device, encoder.dtype,
             encoder.dim, ", under torch.compile" if encoder.compiled else
             ", in graph mode (CUDA graphs)" if encoder.graphed else "")
    return SeamlessFbank(folder, computed), encoder, now


def codec_front_end(trained: dict) -> str:
    """The fbank front-end the codec's features were made with, as its settings record it; transformers' where they
    name none (checkpoints from before front-ends were recorded) or both (a dump of shards of each)."""
    recorded = front_end(trained)
    computed = recorded if recorded in FRONT_ENDS else RECORDED_BEFORE
    log.info("fbank front-end: %s (the codec's features: %s)", computed,
             recorded if "front_end" in trained else f"no front-end recorded, so {RECORDED_BEFORE}")
    return computed
