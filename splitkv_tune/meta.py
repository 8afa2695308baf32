"""Machine and run metadata recorded with every run (``results/<gpu>/runs/<run_id>.json``)."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from splitkv_tune.paths import SOURCE_ROOT
from splitkv_tune.table import atomic_write_text


def make_run_id(now: _dt.datetime | None = None) -> str:
    """Sortable, unique run id: UTC timestamp plus random suffix, e.g. ``20261129T184600Z-3fa2``."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(2)


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=SOURCE_ROOT, capture_output=True, text=True,
                                timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_info() -> dict:
    """Commit of the working tree. ``SPLITKV_GIT_SHA`` overrides it, for copies of a tree whose
    .git is absent or stale (a GPU host's copy); their dirty state is then unknown."""
    override = os.environ.get("SPLITKV_GIT_SHA")
    if override:
        return {"git_sha": override, "git_dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": _git("rev-parse", "HEAD"),
            "git_dirty": bool(status) if status is not None else None}


def _nvml_info(index: int) -> dict:
    import pynvml  # from nvidia-ml-py

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def read(fn, *args):
            try:
                value = fn(handle, *args)
                return value.decode() if isinstance(value, bytes) else value
            except pynvml.NVMLError:
                return None

        reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = read(reasons_fn)
        prefixes = ("nvmlClocksEventReason", "nvmlClocksThrottleReason")
        names = {v: k for k, v in vars(pynvml).items()
                 if k.startswith(prefixes) and isinstance(v, int)}
        return {
            "source": "nvml",
            "uuid": read(pynvml.nvmlDeviceGetUUID),
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "sm_clock_mhz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": read(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_SM),
            "power_limit_w": (read(pynvml.nvmlDeviceGetEnforcedPowerLimit) or 0) / 1000 or None,
            "temperature_c": read(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
            "throttle_reasons": None if reasons is None else sorted(
                name.removeprefix(prefixes[0]).removeprefix(prefixes[1])
                for bit, name in names.items() if reasons & bit and bin(bit).count("1") == 1),
        }
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi_info(index: int) -> dict:
    fields = ["uuid", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm",
              "power.limit", "temperature.gpu", "clocks_throttle_reasons.active"]
    result = subprocess.run(
        ["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(fields)}",
         "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20, check=True)
    values = [v.strip() for v in result.stdout.strip().split(",")]
    keys = ["uuid", "driver", "sm_clock_mhz", "mem_clock_mhz", "max_sm_clock_mhz",
            "power_limit_w", "temperature_c", "throttle_reasons"]
    return {"source": "nvidia-smi", **dict(zip(keys, values))}


def clock_info(index: int) -> dict:
    """Clocks, throttle reasons, UUID and driver through NVML, else nvidia-smi, else a note."""
    notes = []
    try:
        return _nvml_info(index)
    except Exception as err:  # NVML missing or failing: fall back below
        notes.append(f"nvml unavailable ({type(err).__name__}: {err})")
    if shutil.which("nvidia-smi"):
        try:
            return _nvidia_smi_info(index)
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            notes.append(f"nvidia-smi failed ({type(err).__name__})")
    else:
        notes.append("nvidia-smi not found")
    return {"source": None, "note": "clocks omitted: " + "; ".join(notes)}


def device_info(device=None) -> dict:
    """GPU name, SMs, L2 and clocks of ``device`` (CPU description when not a CUDA device)."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    if device.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"type": "cuda", "index": index, "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
            "memory_bytes": props.total_memory, "clocks": clock_info(index)}


def collect_meta(*, device=None, backend: str | None = None, run_id: str | None = None,
                 timing_method: str | None = None, argv: list[str] | None = None,
                 extra: dict | None = None) -> dict:
    """Everything needed to judge a measurement later."""
    import splitkv_tune

    info = {
        "run_id": run_id or make_run_id(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv if argv is None else argv),
        "backend": backend,
        "timing_method": timing_method,
        "device": device_info(device),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cutlass": _package_version("nvidia-cutlass"),
        "optuna": _package_version("optuna"),
        "splitkv_tune": getattr(splitkv_tune, "__version__", None),
        **git_info(),
    }
    if extra:
        info.update(extra)
    return info


def write_run_meta(out_dir: Path, meta: dict) -> Path:
    """Write ``<out_dir>/runs/<run_id>.json`` atomically and return its path."""
    path = Path(out_dir) / "runs" / f"{meta['run_id']}.json"
    atomic_write_text(path, json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
    return path
