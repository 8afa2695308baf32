"""GPU profiles (SMs, copy bandwidth, L2) and GPU name normalisation.

``configs/gpus.yaml`` is the source; ``splitkv_tune/gpu_profiles.py`` is its generated copy
(``python -m splitkv_tune.gpus`` rewrites it, a test checks the two agree), read when the
default profiles are asked for, so the run-time lookup imports no yaml.
"""
from __future__ import annotations

import dataclasses
import functools
import pprint
import re
import sys
from pathlib import Path

from splitkv_tune.paths import PACKAGE_DIR, data_dir

PROFILES_PATH = data_dir("configs") / "gpus.yaml"
GENERATED_PATH = PACKAGE_DIR / "gpu_profiles.py"


@dataclasses.dataclass(frozen=True)
class GpuProfile:
    name: str
    sms: int
    copy_bw_gbps: float
    l2_bytes: int
    smem_per_sm: int
    sm_balance_pct: int = 0

    @property
    def smem_per_block(self) -> int:
        """Largest shared memory one CTA may opt into: the SM's less the 1 KiB reserved per block."""
        return self.smem_per_sm - 1024


def normalize_gpu_name(name: str) -> str:
    """Table name of a GPU: lower case, runs of other characters folded to ``_``.

    >>> normalize_gpu_name("NVIDIA H200")
    'nvidia_h200'
    >>> normalize_gpu_name("NVIDIA A100-SXM4-80GB")
    'nvidia_a100_sxm4_80gb'
    """
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def read_profiles_yaml(path: Path = PROFILES_PATH) -> dict:
    """The profiles file as written (the tools' reader; needs yaml)."""
    import yaml
    return yaml.safe_load(Path(path).read_text())


def _raw_profiles(path: Path) -> dict:
    if Path(path) == PROFILES_PATH:
        from splitkv_tune.gpu_profiles import PROFILES
        return PROFILES
    return read_profiles_yaml(path)


def render_profiles_module(path: Path = PROFILES_PATH) -> str:
    """Text of ``gpu_profiles.py``: the YAML's profiles as a Python literal."""
    return ('"""Generated from configs/gpus.yaml by `python -m splitkv_tune.gpus` -- do not edit."""\n'
            "PROFILES = " + pprint.pformat(read_profiles_yaml(path), width=100, sort_dicts=True)
            + "\n")


@functools.lru_cache(maxsize=None)
def load_profiles(path: Path = PROFILES_PATH) -> dict[str, GpuProfile]:
    raw = _raw_profiles(path)
    for key, v in raw.items():
        balance = v.get("sm_balance_pct", 0)
        if not isinstance(balance, int) or isinstance(balance, bool) or not 0 <= balance <= 100:
            raise ValueError(f"{path}: {key}: sm_balance_pct must be an integer in [0, 100], got {balance!r}")
    return {key: GpuProfile(key, int(v["sms"]), float(v["copy_bw_gbps"]), int(v["l2_bytes"]),
                            int(v["smem_per_sm"]), int(v.get("sm_balance_pct", 0)))
            for key, v in raw.items()}


@functools.lru_cache(maxsize=None)
def _aliases(path: Path = PROFILES_PATH) -> dict[str, str]:
    raw = _raw_profiles(path)
    table = {}
    for key, v in raw.items():
        table[key] = key
        for alias in v.get("aliases", []):
            table[normalize_gpu_name(alias)] = key
    return table


def resolve_gpu(name: str) -> str:
    """Map a ``--gpu`` flag or a device name to the profile key when one matches.

    Unknown names are normalised and returned as they are, so a table can be made for
    any GPU.

    >>> resolve_gpu("h200"), resolve_gpu("NVIDIA H200"), resolve_gpu("NVIDIA A100-SXM4-80GB")
    ('nvidia_h200', 'nvidia_h200', 'nvidia_a100')
    >>> resolve_gpu("Some GPU 9000")
    'some_gpu_9000'
    """
    norm = normalize_gpu_name(name)
    return _aliases().get(norm, norm)


def aliases_of(gpu: str) -> list[str]:
    """The normalised names that resolve to ``gpu``'s profile (``[]`` for a GPU without one).

    >>> aliases_of("h200")
    ['h200', 'nvidia_h200']
    """
    key = resolve_gpu(gpu)
    return sorted(a for a, k in _aliases().items() if k == key and key in load_profiles())


def device_names(gpu: str) -> list[str]:
    """vLLM-style device names of a GPU: its profile's aliases that are device names (they
    contain a space, as ``torch.cuda.get_device_name()`` gives them) with ``_`` for spaces.

    >>> device_names("h100"), device_names("some_gpu")
    (['NVIDIA_H100_80GB_HBM3', 'NVIDIA_H100'], [])
    """
    raw = _raw_profiles(PROFILES_PATH).get(resolve_gpu(gpu), {})
    return [a.replace(" ", "_") for a in raw.get("aliases", []) if " " in a]


def profile_for(name: str) -> GpuProfile | None:
    """The profile of a GPU name or flag, or ``None`` when no profile matches."""
    return load_profiles().get(resolve_gpu(name))


if __name__ == "__main__":
    GENERATED_PATH.write_text(render_profiles_module())
    sys.stdout.write(f"wrote {GENERATED_PATH}\n")
