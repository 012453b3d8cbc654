"""What several commands check the same way before they load a model: the device."""

from __future__ import annotations


def resolve_device(device: str | None) -> str:
    """``--device`` as given (default: ``cuda`` when there is a CUDA GPU, else ``cpu``); a device this torch
    cannot use is refused with one line (torch's own errors are an AssertionError deep in ``.to()``)."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device}: not a device torch knows; use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device {device}: CUDA is not available here ({build}); use --device cpu")
    return device

