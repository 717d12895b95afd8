"""The exported codec's format: tensors (safetensors) and a JSON that names them and says how to use them.

tools/export.py writes them as codec.safetensors (float32) and codec.json; with
them, codes become latents and features without this repo:

- codes -> quantized latent: `latent[t] = project_out(sum_q codebooks[q, codes[t, q]])`,
  `codebooks` is [levels, codebook_size, codebook_dim]; `project_out(v) = v @ W.T + b`,
  the identity when codebook_dim equals latent_dim (then "project_out" is null);
  a code of -1 (a level left out) adds nothing;
- latent -> features: the "decoder" ops in order on [batch, channels, time], then
  `x * feature_std + feature_mean` (features are [time, feature_dim], at
  frame_rate_hz / downsample code frames per second); an utterance of T frames
  keeps the first T of its ceil(T / downsample) x downsample;
- features -> latent -> codes: each utterance's tail padded by repeating its last
  frame to a multiple of downsample ("tail_padding"; ceil(T / downsample) code
  frames), then `(x - feature_mean) / feature_std`, the "encoder" ops,
  then `project_in`, then a beam search over the levels, "beam_size" wide: after
  each level keep the beam_size partial code sequences whose residual (latent less
  the sum of their rows) is smallest, each extended at the next level by its
  beam_size nearest codebook rows (euclidean); the codes are the best sequence.
  With beam_size 1 it is the nearest row per level, subtracted before the next.

Ops: `conv1d` / `conv_transpose1d` (weight, bias, stride, padding), `gelu`
(exact, erf), `residual` (x + body(x)).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from errors import BadInputError
from models.codebook_ops import set_codebooks
from models.codec import CodecConfig, ResidualBlock, RVQCodec
from models.codes import TAIL_PADDING, code_dtype

FORMAT = "rvq-seamless-codec"
VERSION = 1
WEIGHTS = "codec.safetensors"  # an export's tensors, in its folder
NOTE = "codec.json"  # an export's JSON (also in the safetensors metadata under "codec_json")


def _conv(module: nn.Module, name: str, op: str) -> dict:
    if module.groups != 1 or module.dilation != (1,) or module.padding_mode != "zeros" or (
            op == "conv_transpose1d" and module.output_padding != (0,)):
        raise TypeError(f"{name}: only plain convolutions are exported (groups 1, dilation 1, zero padding)")
    return {"op": op, "weight": f"{name}.weight", "bias": f"{name}.bias" if module.bias is not None else None,
            "stride": module.stride[0], "padding": module.padding[0]}


def _op(module: nn.Module, name: str) -> dict:
    if isinstance(module, nn.ConvTranspose1d):
        return _conv(module, name, "conv_transpose1d")
    if isinstance(module, nn.Conv1d):
        return _conv(module, name, "conv1d")
    if isinstance(module, nn.GELU):
        if module.approximate != "none":
            raise TypeError(f"{name}: only the exact GELU is exported")
        return {"op": "gelu"}
    if isinstance(module, ResidualBlock):  # x + conv2(gelu(conv1(gelu(x))))
        body = [{"op": "gelu"}, _op(module.conv1, f"{name}.conv1"), {"op": "gelu"}, _op(module.conv2, f"{name}.conv2")]
        return {"op": "residual", "body": body}
    raise TypeError(f"{name}: {type(module).__name__} has no exported form; extend models/export_format.py")


def describe_ops(sequence: nn.Sequential, prefix: str) -> list[dict]:
    return [_op(module, f"{prefix}.{name}") for name, module in sequence.named_children()]


def export_tensors(model: RVQCodec) -> dict:
    """Every tensor the JSON names, float32 and contiguous, keyed by its name."""
    state = model.state_dict()
    keep = ("encoder", "decoder", "feature_mean", "feature_std")
    tensors = {k: v for k, v in state.items() if k.split(".")[0] in keep}
    tensors.update({k: v for k, v in state.items() if k.startswith(("rvq.project_in.", "rvq.project_out."))})
    tensors["rvq.codebooks"] = model.rvq.codebooks  # [levels, codebook_size, codebook_dim]
    return {k: v.detach().float().cpu().contiguous().clone() for k, v in tensors.items()}


def codec_from_export(meta: dict, tensors: dict[str, torch.Tensor], where: Path) -> RVQCodec:
    """The codec an export describes (`meta`, its codec.json) and holds (`tensors`), in eval mode: export_tensors
    undone, with the codec's own config. Its codes are those of the checkpoint it was exported from, bit for bit
    (float32 weights, as trained); the EMA statistics, which only training reads, were not exported.
    BadInputError naming `where` for an export this version cannot read."""
    try:
        model = RVQCodec(CodecConfig(**meta["checkpoint"]["codec"]))
        codebooks = tensors[meta["tensors"]["codebooks"]]
    except (KeyError, TypeError, ValueError) as e:
        raise BadInputError(f"{where} is not an export of this repo's codec ({type(e).__name__}: {e}): export it "
                            "again with python -m tools.export") from None
    weights = {k: v for k, v in tensors.items() if k != meta["tensors"]["codebooks"]}
    state = model.state_dict()
    quantizer = {k for k in state if k.startswith("rvq.layers.")}  # the codebooks and their training statistics
    wrong = sorted(set(weights) ^ (set(state) - quantizer))
    if wrong or any(weights[k].shape != state[k].shape for k in weights):
        raise BadInputError(f"{where} holds other tensors than its codec.json's codec has "
                            f"({', '.join(wrong[:5]) or 'other shapes'}): export it again with python -m tools.export")
    model.load_state_dict(weights, strict=False)
    try:
        set_codebooks(model, codebooks)
    except ValueError as e:
        raise BadInputError(f"{where}: {e}: export it again with python -m tools.export") from None
    return model.eval()


def describe(model: RVQCodec, state: dict, ckpt_path: Path, kind: dict, digest: str, features: dict) -> dict:
    """codec.json: the codec's shape, the tensors' names, the encoder and decoder ops, and where it came from: the
    checkpoint, its step, config and `digest` (rvq_tokenizer/codec_files.py codec_digest: the same codec, the same
    digest, as code shards record it), and the settings of the `features` it was trained on, as its checkpoint records
    them (what turns audio into its features: rvq_tokenizer/trained_features.py)."""
    c = model.config
    def linear(name):  # the RVQ's own projections, present only when codebook_dim differs from latent_dim
        return {"weight": f"rvq.{name}.weight", "bias": f"rvq.{name}.bias"} if model.rvq.has_projections else None

    return {
        "format": FORMAT, "version": VERSION,
        "feature": {**kind, "dim": c.feature_dim},
        "levels": c.num_quantizers, "codebook_size": c.codebook_size,
        "codebook_dim": int(model.rvq.codebook_dim), "latent_dim": c.latent_dim, "downsample": c.downsample,
        "code_dtype": code_dtype(c.codebook_size).name,
        "tensors": {"codebooks": "rvq.codebooks", "project_in": linear("project_in"),
                    "project_out": linear("project_out"), "feature_mean": "feature_mean",
                    "feature_std": "feature_std"},
        "codes_to_latent": "latent[t] = project_out(sum over levels q of codebooks[q, codes[t, q]]); code -1 adds 0",
        "latent_to_features": "decoder ops on [batch, latent_dim, time], then x * feature_std + feature_mean; an "
                              "utterance of T frames keeps the first T",
        "tail_padding": TAIL_PADDING,
        "code_frames": "ceil(T / downsample) for an utterance of T frames",
        "features_to_latent": "each utterance's tail padded as tail_padding says, then (x - feature_mean) / "
                              "feature_std, then encoder ops on [batch, feature_dim, time]",
        "beam_size": c.beam_size,
        "latent_to_codes": "project_in, then a beam search over the levels beam_size wide: each kept partial code "
                           "sequence extended by its beam_size nearest codebook rows (euclidean) of the residual, the "
                           "beam_size with the smallest residual kept; the codes are the best sequence (beam_size 1: "
                           "per level the nearest row, subtracted before the next level)",
        "layout": "ops act on [batch, channels, time]; features and codes are [time, ...]",
        "encoder": describe_ops(model.encoder, "encoder"),
        "decoder": describe_ops(model.decoder, "decoder"),
        "checkpoint": {"path": str(ckpt_path.resolve()), "step": state.get("step"), "codec": c.to_dict(),
                       "codec_digest": digest, "features": features},
    }
