"""The Seamless fbank in torch: what transformers' SeamlessM4TFeatureExtractor computes, batched, on any device.

For each 25 ms frame every 10 ms (400 samples, hop 160, no centring) of the waveform scaled to 16-bit integers:
the frame's mean removed, pre-emphasis 0.97 within the frame, a Povey window, the power spectrum of a 512-point
FFT, 80 triangular filters on Kaldi's mel scale (20 Hz to 8 kHz, triangles in mel space), the natural log floored
at float32's epsilon; no dither. Then each utterance normalised per mel bin (its mean, and its variance with n - 1,
plus 1e-7) and pairs of frames stacked into 160-d vectors: the extractor pads an odd frame count to an even one
and masks the last stacked frame, so the valid frames are the first 2 x (frames // 2) fbank frames, stacked.

The arithmetic follows the extractor's where its last bits show: the spectrum is computed in float64 and rounded to
complex64 as the extractor stores it, the mel energies and their log in float64, rounded to float32, and the
normalisation in float32 from the float32 log-mel, as numpy computes it. A bin whose values barely vary over a
short utterance divides float32 rounding by a tiny deviation: only the same roundings give the same numbers there.
A float32 FFT is not enough: a pure tone's far bins lie below its rounding.

Each step is rewritten for speed, not changed: (x_i - m) - 0.97 (x_{i-1} - m) = (x_i - 0.97 x_{i-1}) - 0.03 m, so
the pre-emphasis runs once over the waveform; the window is 0 at a frame's first sample, whose pre-emphasis has no
predecessor; the 2^15 scaling (a power of two, exact) is folded into the filters; and the filter bank (97% zeros)
is a sparse matrix.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from data.transfers import to_device

SAMPLE_RATE = 16_000
FRAME_LENGTH = 400  # 25 ms
HOP_LENGTH = 160  # 10 ms
FFT_LENGTH = 512
NUM_MEL_BINS = 80
STRIDE = 2  # fbank frames stacked into one feature vector
DIM = NUM_MEL_BINS * STRIDE
LOW_HZ = 20.0
PREEMPHASIS = 0.97
MEL_FLOOR = 1.192092955078125e-07  # float32's epsilon, the floor under the mel energies before the log
VARIANCE_FLOOR = 1e-7
INT16_SCALE = 2.0 ** 15  # the extractor reads samples in [-1, 1] as 16-bit integers, as Kaldi does
CPU_FRAMES_PER_PASS = 128  # frames computed at once on a CPU (benchmarks/bench_fbank.py)


def povey_window(length: int = FRAME_LENGTH) -> np.ndarray:
    """Kaldi's Povey window: a symmetric Hann window to the power 0.85 (float64)."""
    return np.power(np.hanning(length), 0.85)


def kaldi_mel_filters(num_mel_bins: int = NUM_MEL_BINS, *, fft_length: int = FFT_LENGTH,
                      sample_rate: int = SAMPLE_RATE, low_hz: float = LOW_HZ) -> np.ndarray:
    """[fft_length // 2 + 1, num_mel_bins] float64: triangles evenly spaced on Kaldi's mel scale (1127 ln(1 + f/700))
    from low_hz to half the sample rate, each rising and falling linearly in mel, unnormalised."""
    def mel(hz):
        return 1127.0 * np.log(1.0 + hz / 700.0)

    edges = np.linspace(mel(low_hz), mel(sample_rate // 2), num_mel_bins + 2)
    bins = mel(sample_rate / fft_length * np.arange(fft_length // 2 + 1))
    slopes = edges[None, :] - bins[:, None]
    width = np.diff(edges)
    falling, rising = -slopes[:, :-2] / width[:-1], slopes[:, 2:] / width[1:]
    return np.maximum(0.0, np.minimum(falling, rising))


def fbank_frames(samples: int | torch.Tensor) -> int | torch.Tensor:
    """25 ms frames every 10 ms in `samples` (0 when fewer than one frame's samples)."""
    if isinstance(samples, torch.Tensor):
        return torch.where(samples >= FRAME_LENGTH, 1 + (samples - FRAME_LENGTH).div(HOP_LENGTH, rounding_mode="floor"),
                           0)
    return 1 + (samples - FRAME_LENGTH) // HOP_LENGTH if samples >= FRAME_LENGTH else 0


def feature_frames(samples: int | torch.Tensor) -> int | torch.Tensor:
    """The valid stacked feature frames of `samples` at 16 kHz (the extractor's attention mask's)."""
    return fbank_frames(samples) // STRIDE


class TorchFbank:
    """The Seamless fbank on `device`: `fbank(wave)` for one utterance, `fbank.batch(waves, lengths)` for several.
    `frames_per_pass`: frames whose spectra are computed at once (default: CPU_FRAMES_PER_PASS on a CPU, all on
    another device); each frame's numbers are computed alike whatever their number."""

    def __init__(self, device: torch.device | str = "cpu", frames_per_pass: int | None = None):
        self.device = torch.device(device)
        # on a CPU, passes of frames whose buffers stay in the core's cache; on a GPU, all at once
        self.frames_per_pass = frames_per_pass or (CPU_FRAMES_PER_PASS if self.device.type == "cpu" else None)
        self.dim = DIM
        self.window = torch.from_numpy(povey_window()[1:]).to(self.device)  # its first value is 0 (module doc)
        # [80, 514]: each filter on the FFT's (real, imaginary) pairs, each weight twice (the power's sum is in the
        # product), sparse: a filter covers at most 16 of the 257 bins
        filters = np.repeat(kaldi_mel_filters() * INT16_SCALE ** 2, 2, axis=0).T.copy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch calls its sparse CSR layout beta
            sparse = torch.from_numpy(filters).to_sparse_csr()
            # 32-bit indices, as the sparse kernels take them (else converted at each product)
            self.filters = torch.sparse_csr_tensor(sparse.crow_indices().int(), sparse.col_indices().int(),
                                                   sparse.values(), sparse.shape).to(self.device)

    def __call__(self, wave: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[samples] at 16 kHz, at least FRAME_LENGTH + HOP_LENGTH -> its [feature frames, 160] float32 features, on
        the device: exactly the valid frames."""
        x = torch.as_tensor(wave).to(self.device, torch.float32)[None]
        frames = fbank_frames(x.shape[1])
        if frames < STRIDE:
            raise ValueError(f"{x.shape[1]} samples give {frames} fbank frame(s): at least "
                             f"{FRAME_LENGTH + HOP_LENGTH} samples make one feature frame")
        return self._stacked(self._normalised(self._log_mel(x), None))[0]

    def batch(self, waves: torch.Tensor, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, samples] at 16 kHz, row b valid to lengths[b] -> ([B, frames, 160] float32 features, zero past each
        row's valid frames; [B] valid feature frames), on the device. Each row's features are those of its samples
        alone. `lengths` on the host (a list, an array, a CPU tensor) are checked there and sent without waiting for
        the device's queue (data/transfers.py); waves already on the device stay there."""
        lengths = torch.as_tensor(lengths)
        if lengths.device.type != "cpu":
            lengths = lengths.cpu()
        frames = fbank_frames(lengths)
        if bool((frames < STRIDE).any()):
            raise ValueError(f"rows of {lengths.min().item()} samples make no feature frame: at least "
                             f"{FRAME_LENGTH + HOP_LENGTH} samples make one")
        frames = to_device(frames, self.device)
        log_mel = self._log_mel(to_device(torch.as_tensor(waves), self.device).to(torch.float32))
        valid = torch.arange(log_mel.shape[-1], device=self.device)[None, None, :] < frames[:, None, None]
        features = self._stacked(self._normalised(log_mel, valid))
        kept = torch.arange(features.shape[1], device=self.device)[None, :] < (frames // STRIDE)[:, None]
        return features * kept[..., None], frames // STRIDE

    def _log_mel(self, x: torch.Tensor) -> torch.Tensor:
        """[B, samples] float32 -> [B, 80, fbank frames] float32 log-mel energies (by mel bin), `frames_per_pass`
        frames at a time."""
        x = x.to(torch.float64)  # float32 samples first, as the extractor reads them
        batch, frames = x.shape[0], fbank_frames(x.shape[1])
        framed = x.unfold(1, FRAME_LENGTH, HOP_LENGTH)
        emphasised = torch.add(x[:, 1:], x[:, :-1], alpha=-PREEMPHASIS).unfold(1, FRAME_LENGTH - 1, HOP_LENGTH)
        step = self.frames_per_pass or frames
        padded = x.new_zeros(batch, min(step, frames), FFT_LENGTH)  # its first and last 112 columns stay 0
        log_mel = torch.empty(batch, NUM_MEL_BINS, frames, dtype=torch.float32, device=x.device)
        for first in range(0, frames, step):
            end = min(frames, first + step)
            frame = padded[:, : end - first]
            mean = framed[:, first:end].mean(-1, keepdim=True)
            torch.mul(emphasised[:, first:end].sub(mean, alpha=1 - PREEMPHASIS), self.window,
                      out=frame[:, :, 1:FRAME_LENGTH])
            # the spectrum rounded to complex64 as the extractor stores it, then squared in float64, by bin
            rounded = torch.view_as_real(torch.fft.rfft(frame)).reshape(-1, 2 * (FFT_LENGTH // 2 + 1)).float()
            pairs = x.new_empty(rounded.shape[1], rounded.shape[0]).copy_(rounded.t()).square_()
            mel = torch.sparse.mm(self.filters, pairs).clamp_(min=MEL_FLOOR).log_()
            log_mel[:, :, first:end] = mel.view(NUM_MEL_BINS, batch, end - first).transpose(0, 1)
        return log_mel

    @staticmethod
    def _normalised(log_mel: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Each row's log-mel [B, 80, frames] less its mean over the valid frames, over the square root of their
        variance (n - 1) plus VARIANCE_FLOOR, per mel bin, in float32 as numpy computes it (the mean first, then
        the deviations)."""
        if valid is None:
            count = log_mel.shape[-1]
            mean = log_mel.sum(-1, keepdim=True) / count
            deviation = log_mel - mean
            variance = deviation.square().sum(-1, keepdim=True) / (count - 1)
        else:
            mask = valid.to(log_mel.dtype)
            count = mask.sum(-1, keepdim=True)
            mean = (log_mel * mask).sum(-1, keepdim=True) / count
            deviation = log_mel - mean
            variance = (deviation.square() * mask).sum(-1, keepdim=True) / (count - 1)
        return deviation.div_(variance.add_(VARIANCE_FLOOR).sqrt_())

    @staticmethod
    def _stacked(normalised: torch.Tensor) -> torch.Tensor:
        """[B, 80, fbank frames] -> [B, frames // 2, 160]: frames 2k and 2k + 1 side by side, an odd last dropped."""
        frames = normalised.shape[-1]
        even = frames - frames % STRIDE
        return normalised[:, :, :even].transpose(1, 2).reshape(normalised.shape[0], even // STRIDE, DIM)
