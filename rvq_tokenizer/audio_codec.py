"""A trained codec over audio: the codec, the codes asked of it, the features it was trained on and what computes
them, the input pipeline, and what a code shard records of them. tools.tokenize and rvq_tokenizer both make their
codes with it (`audio_codec`, then `AudioCodec.windows` and `AudioCodec.encode`), so the same audio gets the same
codes from either."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from data.audio.features import SeamlessFbank, W2vBertLayer
from data.audio.pass_plan import shard_passes
from data.audio.pipeline import AudioFile, FeatureWindows
from data.audio.sources import Utterances
from data.transfers import host_copy
from models.codec import RVQCodec
from rvq_tokenizer.codes_spec import CodesRequest, CodesSpec, codes_spec
from rvq_tokenizer.pipeline_settings import PipelineSettings, encoder_passes, resumed_pipeline
from rvq_tokenizer.trained_features import FeatureFlags, feature_maker, trained_features
from training.codec_passes import encode_in_batches


@dataclasses.dataclass(frozen=True)
class AudioCodec:
    """A codec with the features it was trained on, ready to turn audio into codes: the codes asked for (`spec`),
    the fbank and the w2v-BERT layer (None for fbank features) that compute the features, the input pipeline it
    runs, and what a code shard records of them: `codes` (the codec, its codes and the features) and `passes`
    (w2v-BERT's passes and attention kernel; {} for fbank). tools.tokenize and rvq_tokenizer both make their
    codes with it, so the same audio gets the same codes from either."""

    spec: CodesSpec
    fbank: SeamlessFbank
    encoder: W2vBertLayer | None
    pipeline: PipelineSettings
    codes: dict
    passes: dict

    def windows(self, utterances: Utterances, *, num_workers: int, progress: Callable[[float], None] = lambda n: None,
                weight: float = 1.0, on_host: bool = False) -> FeatureWindows:
        """`utterances`' features computed where the codec is, in the pipeline's windows and passes
        (data/audio/pipeline.py): on the host, or (on_host False) left on the device for `encode`."""
        return FeatureWindows(utterances, fbank=self.fbank, encoder=self.encoder, dtype=self.codes["features"]["dtype"],
                              num_workers=num_workers, commit_files=self.pipeline.commit_files,
                              commit_seconds=self.pipeline.commit_seconds,
                              passes=shard_passes(self.passes) if self.encoder else None,
                              progress=progress, weight=weight, device=self.spec.model.feature_mean.device,
                              on_host=on_host)

    def encode(self, kept: list[AudioFile],
               on_batch: Callable[[np.ndarray], None] | None = None) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
        """(the feature frames of the files `kept`, their codes concatenated on the way to the host: call it for
        them), from the features `windows` left on the device, which are then let go. On a GPU the codec's kernels
        are queued and nothing waits for them here (data/transfers.py host_copy). on_batch(positions) after each of
        the codec's passes."""
        spec = self.spec
        lengths = np.array([len(item.features) for item in kept], dtype=np.int64)
        # the features as the dump would store them (FeatureWindows), where they were computed; widened to float32
        # as tools.encode reads a dump's
        features = SimpleNamespace(lengths=lengths, utterance=lambda i: kept[i].features)
        codes = encode_in_batches(spec.model, features, spec.levels, spec.batch_frames, spec.dtype, spec.beam,
                                  on_batch=on_batch, on_device=True)
        for item in kept:
            item.features = None  # the device's memory back
        return lengths, host_copy(codes)


def audio_codec(model: RVQCodec, state: dict, ckpt_path: Path, request: CodesRequest, flags: FeatureFlags,
                pipeline: PipelineSettings, device: torch.device, recorded: dict | None) -> AudioCodec:
    """The codec `model` (its checkpoint `state`, from `ckpt_path`) with the features its checkpoint records, for a
    shard begun with settings `recorded` (None: a new one, or no shard): a w2v-bert shard goes on with its own
    passes, compile and attention kernel (rvq_tokenizer/pipeline_settings.py). BadInputError for features or codes
    the codec does not have."""
    trained = trained_features(state, ckpt_path, flags)
    spec = codes_spec(request, model, state, ckpt_path, device, flags.asker)
    pipeline, before_pass_rules = resumed_pipeline(pipeline, recorded, trained["feature"] == "w2v-bert")
    fbank, encoder, features = feature_maker(trained, flags, device, ckpt_path, before_pass_rules,
                                             compile=pipeline.compile, graphs=pipeline.graphs)
    codes = {**spec.settings, "features": {k: v for k, v in features.items() if k != "checkpoint"}}
    return AudioCodec(spec, fbank, encoder, pipeline, codes, encoder_passes(encoder, pipeline, recorded,
                                                                           before_pass_rules))
