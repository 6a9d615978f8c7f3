"""A GPU's peak dense matmul throughput per precision, for model FLOPs utilisation (MFU).

The figures are the vendors' datasheet numbers for dense (not 2:4 sparse) tensor-core math,
in FLOP/s. A mixed precision's matmuls run in its 16-bit dtype, so `16-mixed`, `bf16-mixed`
and `bf16-true` share the 16-bit peak; `tf32` uses the TF32 tensor-core peak and `32-true`
the plain fp32 one. A card not in the table has no MFU (None), never a guessed one.
"""

# (name fragment, lower-case, most specific first) -> FLOP/s for 16-bit, tf32, fp32.
_TFLOPS = 1e12
_PEAKS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("h100 pcie", (756.0, 378.0, 51.2)),
    ("h100 nvl", (835.0, 417.5, 60.0)),
    ("h100", (989.4, 494.7, 66.9)),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("h200", (989.4, 494.7, 66.9)),
    ("gh200", (989.4, 494.7, 66.9)),
    ("a100", (312.0, 156.0, 19.5)),
    ("l40s", (362.05, 183.0, 91.6)),
    ("l4", (121.0, 60.0, 30.3)),
    ("a10", (125.0, 62.5, 31.2)),
)
_COLUMN = {"16-mixed": 0, "bf16-mixed": 0, "bf16-true": 0, "tf32": 1, "32-true": 2}


def peak_flops_per_s(device_name: str, precision: str) -> float | None:
    """The card's dense peak for the precision's matmuls; None for an unknown card or a CPU."""
    name = device_name.lower()
    # "NVIDIA GH200 ..." contains "h200"; a fragment matches whole words of the name only
    # where that matters ("l4" must not match "l40s"), so compare against the name's words.
    words = name.replace("-", " ").split()
    for fragment, peaks in _PEAKS:
        parts = fragment.split()
        if any(words[i:i + len(parts)] == parts for i in range(len(words))):
            return peaks[_COLUMN[precision]] * _TFLOPS
    return None


def mfu(flops_per_sample: float | None, samples_per_s: float, device_name: str, precision: str) -> float | None:
    """Model FLOPs utilisation: the model's training FLOPs done per second over the card's
    peak for that precision. None when either is unknown."""
    peak = peak_flops_per_s(device_name, precision)
    if flops_per_sample is None or peak is None or samples_per_s <= 0:
        return None
    return flops_per_sample * samples_per_s / peak
